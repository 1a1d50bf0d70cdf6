"""The built-in ``local`` teacher: a causal LM in this process (transformers, CPU or GPU).

:class:`ModelScorer` is the scoring core, shared with the student's top-K scoring: one
teacher-forced forward pass per row (so a row's scores never depend on what it was batched
with), log-softmax of the logits at ``p - 1`` for each requested position ``p``. It reads ids
and returns log-probs; there is no sampling code here at all.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field

from miles_engine.components import Section
from miles_engine.errors import ConfigError
from miles_engine.teachers.compat import VocabFingerprint, fingerprint_tokenizer
from miles_engine.teachers.protocol import ScoreRequest, TeacherError, TokenScores


class ModelScorer:
    """Scores rows with a causal LM (``model(input_ids).logits``); thread-safe, one pass at a time."""

    def __init__(self, model: Any, *, temperature: float = 1.0, device: str | None = None) -> None:
        import torch

        self.model = model
        self.temperature = temperature
        self.device = torch.device(device) if device else next(model.parameters()).device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._lock = threading.Lock()

    def score_one(self, req: ScoreRequest) -> TokenScores:
        import torch

        n = len(req.token_ids)
        bad = next((t for t in req.token_ids if not 0 <= int(t) < self.vocab_size), None)
        if bad is not None:
            raise TeacherError(f"token id {bad} is outside the teacher's vocabulary (0..{self.vocab_size - 1})")
        ids = torch.tensor([list(req.token_ids)], dtype=torch.long, device=self.device)
        pos = torch.tensor(list(req.positions), dtype=torch.long, device=self.device)
        with self._lock, torch.inference_mode():
            logits = self.model(input_ids=ids, use_cache=False).logits[0]
            logp = torch.log_softmax(logits.index_select(0, pos - 1).float() / self.temperature, dim=-1)
            out = [0.0] * n
            if len(pos):
                sampled = logp.gather(1, ids[0].index_select(0, pos)[:, None]).squeeze(1).tolist()
                for p, lp in zip(req.positions, sampled):
                    out[p] = float(lp)
            scores = TokenScores(out)
            if req.top_k and len(pos):
                k = min(req.top_k, logp.shape[-1])
                # ties broken by the lower id, so the answer is deterministic across backends
                order = torch.sort(logp, dim=-1, descending=True, stable=True)
                scores.top_ids = order.indices[:, :k].tolist()
                scores.top_logprobs = order.values[:, :k].tolist()
            if req.candidate_ids is not None:
                for row, cands in zip(logp, req.candidate_ids):
                    if any(not 0 <= int(c) < self.vocab_size for c in cands):
                        raise TeacherError(f"candidate ids {list(cands)} leave the vocabulary (0..{self.vocab_size - 1})")
                    idx = torch.tensor(list(cands), dtype=torch.long, device=self.device)
                    scores.candidate_logprobs.append(row.index_select(0, idx).tolist())
        return scores

    async def score(self, requests: Sequence[ScoreRequest]) -> list[TokenScores]:
        return await asyncio.to_thread(lambda: [self.score_one(r) for r in requests])


class LocalTeacherOptions(Section):
    model: str | dict[str, Any] | None = Field(
        None, description="a model directory (HF weights, GGUF or config.json), a tiny: spec or a config dict; "
        "None only for the teacher that opd.teacher_training builds")
    tokenizer: str | None = Field(None, description="the teacher's tokenizer (file or dir); default: the model dir")
    device: str = Field("cpu", description="cpu, cuda, cuda:N")
    dtype: Literal["float32", "bfloat16"] = "float32"
    temperature: float = Field(1.0, gt=0, description="the teacher's logits are divided by this")
    seed: int = Field(0, description="random init seed when model is a config")


class LocalTeacher:
    """A teacher model loaded in this process; ``fingerprint`` reads its own tokenizer."""

    def __init__(self, options: LocalTeacherOptions, *, name: str = "local") -> None:
        from miles_engine.models.loading import load_model

        if options.model is None:
            raise ConfigError(f"teacher '{name}': options.model is required (a model directory or config)")
        tok = options.tokenizer or (options.model if isinstance(options.model, str)
                                    and not options.model.startswith("tiny:") else None)
        if tok is None:
            raise ConfigError(f"teacher '{name}': options.tokenizer is required when options.model is a config "
                              f"(the tokenizer check needs the teacher's own tokenizer)")
        self.name, self.options, self._tokenizer_source = name, options, tok
        model, self.description = load_model(options.model, dtype=options.dtype, device=options.device,
                                             seed=options.seed)
        self.scorer = ModelScorer(model, temperature=options.temperature)

    def fingerprint(self, probe: str, special_tokens: Sequence[str]) -> VocabFingerprint:
        return fingerprint_tokenizer(self._tokenizer_source, probe, special_tokens)

    async def score(self, requests: Sequence[ScoreRequest]) -> list[TokenScores]:
        return await self.scorer.score(requests)

    async def aclose(self) -> None:
        self.scorer.model = None


def make_local_teacher(options: LocalTeacherOptions) -> LocalTeacher:
    return LocalTeacher(options)

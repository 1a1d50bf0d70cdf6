"""Deterministic scripted rollout engines for ``miles tito check``, tests and benches.

:class:`ScriptedEngine` follows the :class:`~miles_engine.engines.protocol.RolloutEngine`
protocol. A ``reply(input_ids, request)`` callable decides each output as text (tokenized
*non-canonically* by default, as a real model often samples: some tokens split into
per-character pieces, so any re-tokenization by the server would show) or as ids. Output stops
at the first requested stop id, which is included (as engines return it); text without one
finishes with ``length``. Every request and result is recorded.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from miles_engine.engines.protocol import GenerateRequest, GenerateResult, PauseMode, TensorMeta
from miles_engine.models.tokenizer import TitoTokenizer

Reply = Callable[[Sequence[int], GenerateRequest], "str | list[int]"]


def noncanonical_ids(tok: TitoTokenizer, text: str, every: int = 2) -> list[int]:
    """Tokenize ``text`` so it decodes back to ``text`` but every ``every``-th multi-character
    token is spelled character by character (added tokens stay whole)."""
    out: list[int] = []
    for i, t in enumerate(tok.encode(text)):
        piece = tok.piece(t)
        if t in tok.added_ids or len(piece) < 2 or "\ufffd" in piece or i % every:
            out.append(t)
            continue
        split = [x for ch in piece for x in tok.encode(ch)]
        out.extend(split if tok.decode(split) == piece and len(split) > 1 else [t])
    return out


def random_policy(tok: TitoTokenizer, stop_ids: Sequence[int], *, seed: int = 0, max_len: int = 24) -> Reply:
    """Uniformly random ordinary tokens, then a stop token: the hardest case for exactness."""
    rng = random.Random(seed)
    ordinary = [i for i in range(tok.vocab_size) if i not in tok.added_ids]

    def reply(_ids: Sequence[int], _req: GenerateRequest) -> list[int]:
        return [rng.choice(ordinary) for _ in range(rng.randint(1, max_len))] + [rng.choice(list(stop_ids))]

    return reply


class ScriptedEngine:
    def __init__(self, tokenizer: TitoTokenizer, reply: Reply | None = None, *, canonical: bool = False,
                 delay_s: float = 0.0, routed_shape: tuple[int, int] | None = None, fail: BaseException | None = None,
                 finish_reason: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.reply: Reply = reply or (lambda _ids, _req: "ok")
        self.canonical = canonical
        self.delay_s = delay_s
        self.routed_shape = routed_shape
        self.fail = fail
        self.force_finish = finish_reason
        self.version = 0
        self.requests: list[GenerateRequest] = []
        self.results: list[GenerateResult] = []
        self.aborted: list[str] = []
        self._waiting: dict[str, asyncio.Event] = {}

    @property
    def weight_version(self) -> int:
        return self.version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        if self.delay_s:  # an abort ends the wait early with finish_reason "abort"
            event = self._waiting[request.request_id] = asyncio.Event()
            try:
                await asyncio.wait_for(event.wait(), self.delay_s)
            except TimeoutError:
                pass
            finally:
                self._waiting.pop(request.request_id, None)
            if event.is_set():
                return GenerateResult(request.request_id, [], [], [], "abort", len(request.input_ids))
        if self.fail is not None:
            raise self.fail
        out = self.reply(list(request.input_ids), request)
        if isinstance(out, str):
            ids = self.tokenizer.encode(out) if self.canonical else noncanonical_ids(self.tokenizer, out)
        else:
            ids = list(out)
        finish = "length"
        stops = set(request.sampling.stop_token_ids)
        for i, t in enumerate(ids):
            if t in stops:
                ids, finish = ids[: i + 1], "stop"
                break
        if len(ids) > request.sampling.max_new_tokens:
            ids, finish = ids[: request.sampling.max_new_tokens], "length"
        start = len(request.input_ids)
        routed = None
        if request.return_routed_experts and self.routed_shape:
            layers, k = self.routed_shape
            routed = [[[(start + i + j + layer) % 8 for j in range(k)] for layer in range(layers)]
                      for i in range(len(ids))]
        result = GenerateResult(
            request_id=request.request_id, output_ids=ids,
            output_logprobs=[-0.01 * (1 + (start + i) % 13) for i in range(len(ids))],
            weight_versions=[self.version] * len(ids), finish_reason=self.force_finish or finish,  # type: ignore[arg-type]
            prompt_tokens=start, routed_experts=routed,
        )
        self.results.append(result)
        return result

    async def pause(self, mode: PauseMode = "retract") -> None: ...

    async def resume(self) -> None: ...

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        event = self._waiting.get(request_id)
        if event is not None:
            event.set()
        return event is not None

    async def update_weights(self, weights: Mapping[str, Any] | Path, *, version: int | None = None) -> int:
        self.version = version if version is not None else self.version + 1
        return self.version

    def weight_metadata(self) -> list[TensorMeta]:
        return []

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None: ...

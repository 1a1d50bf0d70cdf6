"""The speculative draft model inside an embedded engine: loading it next to the policy, and its
tensors as a weight update names them (``draft.<name>``), so a run that co-trains the draft
(``speculative.train``) pushes them with the policy's through any transport."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from miles_engine.engines.embedded import weights as W
from miles_engine.engines.embedded.runner import ModelRunner
from miles_engine.engines.protocol import TensorMeta
from miles_engine.errors import ConfigError, WeightUpdateError
from miles_engine.models.loading import fit_draft_vocab, load_model

DRAFT_PREFIX = "draft."  # weight names of the speculative draft model in an update


def use_packed_gqa(model: Any) -> None:
    from miles_engine.engines.embedded.attention import NAME

    model.set_attn_implementation(NAME)


def load_draft(source: Any, policy: ModelRunner, vocab_size: int, seed: int) -> ModelRunner:
    """The speculative draft: same device and dtype as the policy, its own weights and KV cache;
    refused unless its vocabulary is the policy's (proposals are token ids)."""
    dtype = str(policy.dtype).removeprefix("torch.")
    try:
        draft, desc = load_model(fit_draft_vocab(source, vocab_size), dtype=dtype, device=str(policy.device),
                                 seed=seed)
    except Exception as exc:
        raise ConfigError(f"speculative.draft_model {source!r} could not be loaded: {exc}") from exc
    draft.eval()
    size = int(draft.get_input_embeddings().num_embeddings)
    out = int(draft.get_output_embeddings().weight.shape[0]) if draft.get_output_embeddings() is not None else size
    if size != vocab_size or out != vocab_size:
        raise ConfigError(f"speculative.draft_model {desc} has a vocabulary of {size} tokens (output {out}), "
                          f"the policy's has {vocab_size}: a draft must share the policy's tokenizer")
    if getattr(draft.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        draft.set_attn_implementation("sdpa")
    if draft.config._attn_implementation == "sdpa":
        use_packed_gqa(draft)  # its catch-up forwards are multi-token queries too
    return ModelRunner(draft, pad_token_id=policy.pad_token_id)


class DraftWeights:
    """The draft's live tensors (none without a draft model) and how many updates reached them."""

    def __init__(self, runner: ModelRunner | None, *, method: str, served: bool) -> None:
        self.tensors = W.model_tensors(runner.model) if runner is not None else {}
        self.method, self.served = method, served  # served: co-trained, its names are the engine's too
        self.updates = 0

    def metadata(self) -> list[TensorMeta]:
        return [TensorMeta(DRAFT_PREFIX + m.name, m.dtype, m.shape, m.format) for m in W.metadata(self.tensors)]

    def served_tensors(self) -> dict[str, torch.Tensor]:
        return {DRAFT_PREFIX + n: t for n, t in self.tensors.items()} if self.served else {}

    def split(self, weights: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """``draft.*`` tensors (checked against the draft) apart from the policy's."""
        policy = {k: v for k, v in weights.items() if not (isinstance(k, str) and k.startswith(DRAFT_PREFIX))}
        if len(policy) == len(weights):
            return policy, {}
        if not self.tensors:
            raise WeightUpdateError(f"weight update refused, nothing was changed: it carries {DRAFT_PREFIX}* tensors "
                                    f"but this engine has no draft model (speculative.method is {self.method!r})")
        draft = {k[len(DRAFT_PREFIX):]: v for k, v in weights.items() if k not in policy}
        return policy, W.from_mapping(draft, self.tensors)

    def apply(self, draft: Mapping[str, torch.Tensor]) -> None:
        W.apply(draft, self.tensors)
        self.updates += 1

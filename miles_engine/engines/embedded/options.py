"""Typed options of the embedded engine (importable without torch)."""

from __future__ import annotations

from typing import Any, Literal

from miles_engine.precision.config import StageFormat

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SpeculativeOptions(BaseModel):
    """Speculative decoding: a proposer guesses up to ``num_tokens`` next tokens of every running
    row, the policy checks them all in one forward and keeps what exact speculative sampling
    accepts (greedy: identical output; T > 0: the same distribution; log-probs the policy's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["none", "ngram", "draft"] = Field(
        "none", description="none; ngram: copy what followed an earlier occurrence of the sequence's last n "
        "tokens (prompt included); draft: a small model on the same tokenizer proposes")
    num_tokens: int = Field(4, ge=1, le=16, description="tokens proposed per row and step")
    prompt_lookup_min: int = Field(1, ge=1, le=64, description="ngram: shortest suffix matched")
    prompt_lookup_max: int = Field(4, ge=1, le=64, description="ngram: longest suffix matched (tried first)")
    backoff: bool = Field(
        True, description="a row whose proposals were all rejected twice in a row stops proposing for 1, 2, 4, "
        "... 32 steps (then tries again): rejected proposals are pure cost (exactness does not depend on it)")
    draft_model: str | dict[str, Any] | None = Field(
        None, description="draft: the draft model, in any form the engine takes its model (directory, .gguf, "
        "config.json, tiny: spec, config dict); its vocabulary must be the policy's")
    train: bool = Field(
        False, description="draft: train the draft alongside the policy -- every step on the tokens the policy "
        "sampled (next-token cross-entropy: the draft learns the current policy's distribution, which is what "
        "acceptance measures), pushed to the engines with the policy's weights")
    train_lr: float = Field(1e-4, gt=0, le=1, description="train: the draft's AdamW learning rate")
    train_epochs: int = Field(1, ge=1, le=16, description="train: passes over each step's sampled rows")
    train_batch_tokens: int = Field(8192, ge=64, description="train: padded tokens per micro-batch")

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeOptions:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) is larger than prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("method 'draft' needs draft_model (the draft model's path or spec)")
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(f"draft_model is only read by method 'draft', not {self.method!r}")
        if self.train and self.method != "draft":
            raise ValueError(f"train: true trains a draft model: it needs method 'draft' (with draft_model), "
                             f"not {self.method!r}")
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "none"


class EmbeddedEngineOptions(BaseModel):
    """How the embedded engine runs a model. Unknown keys are an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field("cpu", description="torch device string: cpu, cuda, cuda:1, ...")
    max_batch_size: int = Field(64, ge=1, description="most sequences decoded in one step")
    max_context: int | None = Field(
        None, ge=2, description="prompt + output token limit; default: the model's max_position_embeddings"
    )
    num_threads: int | None = Field(
        1, ge=1, description="torch intra-op threads (process-wide setting); None leaves torch's default"
    )
    seed: int = Field(0, description="seeds random init from a config and the streams of unseeded requests")
    session_cache_tokens: int = Field(
        1 << 17, ge=0, description="token budget of the per-session prefix-cache LRU (0 disables reuse)"
    )
    prompt_cache_tokens: int = Field(
        1 << 15, ge=0, description="token budget of the shared-prompt cache: a request whose whole prompt an "
        "earlier request prefilled under the same weights (the attempts of a GRPO group) reuses that KV and "
        "prefills only its last token (0 disables)"
    )
    max_prefill_tokens: int = Field(
        8192, ge=1, description="padded tokens per batched prefill forward (a longer prompt runs alone)"
    )
    attn_implementation: str = Field("sdpa", description="transformers attention implementation")
    true_on_policy: bool = Field(
        False, description="batch-invariant arithmetic (miles_engine.batch_invariant): every token's log-prob "
        "is bit-identical to the trainer's with trainer.true_on_policy, whatever the batch, padding or cache; "
        "slower. Float32 only. A recipe derives it from trainer.true_on_policy")
    weight_format: StageFormat = Field(
        "full", description="hold and compute with the values of this quantised format (the rollout stage of "
        "the precision contract; a recipe derives it from precision.rollout): every nn.Linear weight but the "
        "output head, at load and at every update")
    weight_storage: Literal["codes", "values"] = Field(
        "codes", description="how weights in weight_format are held: codes (codes + scales, the format's memory; "
        "each forward decodes them, which costs time where no fused kernel runs, e.g. this CPU) or values (the "
        "decoded values in the engine's dtype as well: full-precision memory plus the codes, no decode per "
        "forward); the same numbers either way")
    kv_cache: Literal["full", "fp8"] = Field(
        "full", description="fp8: keys and values are stored and attended as E4M3 with a float32 scale per token "
        "and head (precision.kv_cache); prompt scoring reads them the same way")
    weight_exceptions: tuple[str, ...] = Field((), description="weight names (fnmatch) kept in high precision "
                                               "(precision.exceptions)")
    speculative: SpeculativeOptions = Field(
        default_factory=SpeculativeOptions, description="speculative decoding (exact: the policy's tokens and "
        "log-probs); works with true_on_policy, the caches, sessions and R3 recording")

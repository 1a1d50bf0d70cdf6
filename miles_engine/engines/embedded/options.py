"""Typed options of the embedded engine (importable without torch)."""

from __future__ import annotations

from typing import Literal

from miles_engine.precision.config import StageFormat

from pydantic import BaseModel, ConfigDict, Field


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
    kv_cache: Literal["full", "fp8"] = Field(
        "full", description="fp8: keys and values are stored and attended as E4M3 with a float32 scale per token "
        "and head (precision.kv_cache); prompt scoring reads them the same way")
    weight_exceptions: tuple[str, ...] = Field((), description="weight names (fnmatch) kept in high precision "
                                               "(precision.exceptions)")

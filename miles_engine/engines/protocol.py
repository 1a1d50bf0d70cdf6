"""The rollout-engine protocol the trainer, the TITO server and the evaluator sit on.

Everything is token ids, never text. Every output token comes back with the log-prob it
was sampled with (under the sampling distribution actually used: after temperature /
top-p / top-k) and the weight version that produced it, so a trainer can correct for
train–rollout mismatch and account staleness per token.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "retract", "in_place", "wait"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "retract", "in_place", "wait")
# what a pause did to running requests: the counters engines keep (stats()) and servers report
PAUSE_EFFECTS = ("retracted", "kept_in_place", "aborted")


class SamplingParams(BaseModel):
    """Sampling settings; unknown keys are an error (``extra="forbid"``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1 disables top-k")
    max_new_tokens: int = Field(128, ge=1)
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    @model_validator(mode="after")
    def _check_top_k(self) -> SamplingParams:
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        return self


@dataclass
class GenerateRequest:
    input_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session_id: str | None = None
    return_logprob: bool = True
    return_routed_experts: bool = False
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class GenerateResult:
    request_id: str
    output_ids: list[int]
    output_logprobs: list[float]
    weight_versions: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int = 0
    # ints [output_tokens, moe_layers, top_k] when requested on an MoE model
    routed_experts: list[list[list[int]]] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    format: str | None = None  # the quantised format the engine holds it in (miles_engine.precision), if any


@runtime_checkable
class RolloutEngine(Protocol):
    """A rollout engine. All methods are safe to call concurrently from one event loop."""

    @property
    def weight_version(self) -> int: ...

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    async def pause(self, mode: PauseMode = "retract") -> None:
        """Stop scheduling new decode steps. ``abort``: in-flight requests finish with
        ``finish_reason="abort"``; ``retract``: they are put back and re-prefilled on the new
        weights after :meth:`resume`; ``in_place``: they keep their KV cache and continue;
        ``wait``: no new request starts, the running ones finish (on the current weights) before
        this returns."""
        ...

    async def resume(self) -> None: ...

    async def abort(self, request_id: str) -> bool: ...

    async def update_weights(
        self, weights: Mapping[str, Any] | Path, *, version: int | None = None
    ) -> int:
        """Load named tensors (or a safetensors directory); refuse mismatched names/shapes/dtypes
        before changing anything. Returns the new weight version."""
        ...

    def weight_metadata(self) -> list[TensorMeta]: ...

    async def health(self) -> bool: ...

    async def aclose(self) -> None: ...


async def engine_version(engine: Any) -> int:
    """The version the engine itself reports (``fetch_weight_version`` when it has one)."""
    fetch = getattr(engine, "fetch_weight_version", None)
    return int(await fetch()) if fetch is not None else int(engine.weight_version)


def served_tensors(engine: Any, names: Iterable[str] | None = None) -> dict[str, Any] | None:
    """An in-process engine's live tensors under the names a push carries (``served_tensors()``
    where the engine has it: a co-trained draft's ``draft.*`` included), else its model's
    ``state_dict()`` -- only ``names`` (those it has) when given; None for an engine in another
    process."""
    served = getattr(engine, "served_tensors", None)
    if served is not None:
        return served() if names is None else served(list(names))
    model = getattr(engine, "model", None)
    if model is None or not hasattr(model, "state_dict"):
        return None
    tensors = dict(model.state_dict())
    return tensors if names is None else {n: tensors[n] for n in names if n in tensors}

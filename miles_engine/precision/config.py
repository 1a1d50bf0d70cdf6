"""The recipe's ``precision`` section: one contract for the four stages that touch the weights
(checkpoint conversion, the trainer's forward, the online export, rollout).

Valid pairs: the same format in training and rollout (quantisation-aware training: the trainer's
forward computes with exactly the values the engine holds), or full-precision training with a
quantised rollout ("BF16 train + FP8 serve") -- except NVFP4, which every stage must use. The
exception list is one list, read by every stage; an engine option that quantises on its own (a
stage-only override) is refused when the recipe is loaded.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Literal

from pydantic import Field, model_validator

from miles_engine.components import Section
from miles_engine.errors import MilesError

StageFormat = Literal["full", "fp8", "mxfp8", "nvfp4", "int4"]

# engine options that would quantise one stage behind the contract's back
STAGE_ONLY_KEYS = ("quantization", "kv_cache_dtype", "weight_format")
STAGE_ONLY_FLAGS = ("--quantization", "--kv-cache-dtype")


class PrecisionGapError(MilesError):
    """A step's train-rollout log-prob gap exceeded ``precision.max_logprob_gap``."""


class PrecisionConfig(Section):
    train: StageFormat = Field("full", description="the trainer's forward: full (its own dtype) or a format it "
                               "fake-quantises the weights to (straight-through gradients)")
    rollout: StageFormat = Field("full", description="the format the engines hold and compute with; the online "
                                 "export ships it (values + scales)")
    kv_cache: Literal["full", "fp8"] = Field("full", description="the engines' KV cache (fp8: keys and values "
                                             "stored and attended as E4M3 with a float32 scale per token and head)")
    exceptions: list[str] = Field(default_factory=list, description="weight names (fnmatch patterns, e.g. "
                                  "'model.layers.23.*', '*.shared_experts.*') kept in high precision in every stage")

    max_logprob_gap: float | None = Field(
        None, gt=0, description="stop the run when a step's mean |trainer - engine| log-prob on the sampled tokens "
        "of the current weights (tis/numerics_abs_diff) exceeds this, naming the tensor class whose quantisation "
        "moves the trainer's log-probs most")

    @model_validator(mode="after")
    def _pair(self) -> PrecisionConfig:
        train, rollout = self.train, self.rollout
        if "nvfp4" in (train, rollout) and train != rollout:
            raise ValueError(f"precision.train={train!r} with precision.rollout={rollout!r}: NVFP4 must be used in "
                             f"every stage (set both precision.train and precision.rollout to nvfp4)")
        if train != "full" and train != rollout:
            raise ValueError(f"precision.train={train!r} with precision.rollout={rollout!r}: a quantised trainer "
                             f"needs the same format in rollout (valid pairs: the same format in both, or "
                             f"precision.train=full with a quantised rollout)")
        return self

    @property
    def quantised(self) -> bool:
        return self.rollout != "full"

    def is_exception(self, name: str) -> bool:
        return any(fnmatchcase(name, pattern) for pattern in self.exceptions)

    def format_for(self, stage: Literal["train", "rollout"], name: str) -> str | None:
        """The format a weight takes in ``stage`` (None: high precision)."""
        fmt = self.train if stage == "train" else self.rollout
        return None if fmt == "full" or self.is_exception(name) else fmt


def stage_only_overrides(engine_groups: list) -> list[str]:
    """``engines.N.options`` keys and flags that set a quantisation for the engines alone."""
    found = []
    for i, group in enumerate(engine_groups):
        options = getattr(group, "options", None) or {}
        found += [f"engines.{i}.options.{key}" for key in STAGE_ONLY_KEYS if key in options]
        for arg in options.get("extra_args", []) or []:
            flag = str(arg).split("=", 1)[0]
            if flag in STAGE_ONLY_FLAGS:
                found.append(f"engines.{i}.options.extra_args {flag}")
    return found


"""The recipe's ``reward:`` section: which components score an episode, their weights, and what
the buffer does with a trajectory whose reward could not be computed."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from miles_engine.components import Section

TASK_VERIFIER = "task"  # the built-in component that runs the environment's own verifier


class RewardComponentRef(Section):
    """One weighted term of a reward stack."""

    name: str = Field(description="a registered reward (see `miles plugins`) or a dotted import path")
    label: str | None = Field(None, description="key in the logged components (default: the name)")
    weight: float = Field(1.0, description="the term's weight in the sum")
    timeout_s: float | None = Field(None, gt=0, description="deadline of this term alone")
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("weight")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"weight must be a finite number, got {v}")
        return v

    @property
    def key(self) -> str:
        return self.label or self.name


class RewardConfig(Section):
    """``reward:`` — ``components`` unset keeps the environment's own verifier, unchanged.

    ``on_error`` decides what happens to a group with a trajectory whose verifier failed
    (``reward: None`` with an error): ``drop`` drops the whole group, ``zero`` keeps the
    trajectory with reward 0.0 (tagged ``failure=reward_error``); unset, such trajectories follow
    ``buffer.partial_failure`` like any other failed attempt.
    """

    components: list[RewardComponentRef] | None = Field(
        None, min_length=1, description=f"weighted terms summed into the reward; '{TASK_VERIFIER}' is the task's verifier"
    )
    on_error: Literal["drop", "zero"] | None = None

    @model_validator(mode="after")
    def _unique_keys(self) -> RewardConfig:
        seen: set[str] = set()
        for ref in self.components or []:
            if ref.key in seen:
                raise ValueError(f"two reward components are labelled '{ref.key}': give each a distinct `label`")
            seen.add(ref.key)
        return self

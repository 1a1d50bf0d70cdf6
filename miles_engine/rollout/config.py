"""The recipe's ``rollout`` section: the scheduler's own options plus the rollout mode."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from miles_engine.rollout.scheduler import SchedulerOptions


class RolloutConfig(SchedulerOptions):
    """The scheduler's own options (group_size, max_inflight, episode_timeout_s, poll_s) plus the mode."""

    mode: Literal["sync", "one_step_off", "fully_async"] = "fully_async"
    groups_per_step: int = Field(8, ge=1)
    task_seed: int = 0

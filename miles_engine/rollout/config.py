"""The recipe's ``rollout`` section: the scheduler's own options plus the rollout mode."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from miles_engine.rollout.scheduler import SchedulerOptions


class RolloutConfig(SchedulerOptions):
    """The scheduler's own options (group_size, max_inflight, episode_timeout_s, poll_s) plus the mode."""

    mode: Literal["sync", "one_step_off", "fully_async"] = "fully_async"
    on_update: Literal["retract", "in_place", "abort", "wait"] = Field(
        "retract", description="what a weight push does to the requests generating at that moment (partial "
        "rollouts): retract: put back, re-prefilled on the new weights with their tokens so far, under the "
        "same ids; in_place: keep their KV and go on with the new weights; abort: end them (the turn's "
        "partial output is dropped, counted, and asked again); wait: the push waits until they finish on the "
        "old weights. Tokens carry the version that sampled them in every mode; sync rollouts have none "
        "running at a push")
    groups_per_step: int = Field(8, ge=1)
    task_seed: int = 0

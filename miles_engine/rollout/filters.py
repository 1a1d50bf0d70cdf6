"""Put-time filters of the async buffer: failed trajectories, partial-failure policy, user filter.

A trajectory has *failed* when its status is not ``"ok"`` (``failed`` / ``timeout`` /
``aborted``) or it has no usable reward (``no_reward``: ``None`` or NaN). Policies for a group
with some failed trajectories (a group whose trajectories all failed is always dropped):

- ``zero_reward`` (default): failed trajectories stay with reward 0.0 and ``tags["failure"]``,
  so a timed-out or crashed attempt scores like a wrong answer (no hidden selection toward
  short or easy episodes); failed trajectories without a sampled token are removed (nothing to
  train on);
- ``drop_failed``: failed trajectories are removed (infrastructure noise is not blamed on the
  policy; this selects against long, timing-out episodes — watch the length-bucket acceptance);
- ``drop_group``: the whole group is dropped.

A trajectory kept with reward 0.0 gets status ``"ok"`` (the trainer trains on ``ok`` rows only);
its failure stays visible in ``tags["failure"]`` and ``error``.

Verifier failures (status ``reward_error``) follow the recipe's ``reward.on_error`` when it is
set — ``drop``: the whole group is dropped (reason ``reward_error``); ``zero``: the trajectory is
kept with reward 0.0 whatever ``partial_failure`` says — and ``partial_failure`` otherwise.

After removal, a group with fewer than ``min_group_size`` trajectories is dropped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from miles_engine.rollout.types import Group, Trajectory

log = logging.getLogger(__name__)
GroupFilter = Callable[[Group], Any]
RewardErrorPolicy = Literal["drop", "zero"] | None
REWARD_ERROR = "reward_error"


def failure_reason(t: Trajectory) -> str | None:
    if t.status != "ok":
        return t.status
    if t.reward is None or (isinstance(t.reward, float) and math.isnan(t.reward)):
        return "no_reward"
    return None


@dataclass
class FailureVerdict:
    drop: str | None = None  # reason to drop the whole group
    failures: list[str] = field(default_factory=list)  # reason of each failed trajectory
    removed: list[Trajectory] = field(default_factory=list)  # trajectories taken out of a kept group


def apply_failure_policy(group: Group, policy: str, min_group_size: int,
                         on_reward_error: RewardErrorPolicy = None) -> FailureVerdict:
    """Apply ``policy`` (and ``on_reward_error`` to verifier failures) to ``group`` (mutates it when kept)."""
    reasons = [failure_reason(t) for t in group.trajectories]
    verdict = FailureVerdict(failures=[r for r in reasons if r is not None])
    if not group.trajectories or len(verdict.failures) == len(group.trajectories):
        verdict.drop = "all_failed"
        return verdict
    if not verdict.failures:
        return verdict
    if on_reward_error == "drop" and REWARD_ERROR in reasons:
        verdict.drop = REWARD_ERROR
        return verdict
    zero_reward_errors = on_reward_error == "zero"
    general = [r for r in verdict.failures if not (zero_reward_errors and r == REWARD_ERROR)]
    if policy == "drop_group" and general:
        verdict.drop = "partial_failure"
        return verdict
    keep: list[Trajectory] = []
    for t, r in zip(group.trajectories, reasons):
        if r is None:
            keep.append(t)
        elif (policy == "zero_reward" or (zero_reward_errors and r == REWARD_ERROR)) and t.num_sampled > 0:
            t.reward, t.status, t.tags["failure"] = 0.0, "ok", r
            keep.append(t)
        else:
            verdict.removed.append(t)
    if len(keep) < min_group_size:
        verdict.drop, verdict.removed = "too_few_ok", []
        return verdict
    if verdict.removed:
        group.info["removed_failed"] = len(verdict.removed)
    group.trajectories = keep
    return verdict


def user_filter_reason(filter_fn: GroupFilter | None, group: Group) -> str | None:
    """``None`` to keep; else the drop reason (``user``, ``user:<reason>``, ``user_filter_error``).
    ``filter_fn(group)`` returns a bool, a ``(keep, reason)`` tuple, or an object with ``keep``
    (and optionally ``reason``); a raising filter drops the group, logged, never crashes the run."""
    if filter_fn is None:
        return None
    try:
        verdict = filter_fn(group)
    except Exception:  # noqa: BLE001
        log.exception("buffer: user filter raised on group %s", group.group_id)
        return "user_filter_error"
    if isinstance(verdict, tuple):
        keep, why = verdict[0], (verdict[1] if len(verdict) > 1 else None)
    else:
        keep, why = getattr(verdict, "keep", verdict), getattr(verdict, "reason", None)
    return None if keep else (f"user:{why}" if why else "user")

"""Staleness accounting of finished groups, admission control, and length-bucket acceptance.

Per group, with ``v`` the policy version the trainer is about to train (``current``) and the
versions of every *sampled* token of every trajectory in the group:

- ``s_old``  = v − min(token versions): how old the oldest sampled token is. This is the value
  the ``max_staleness`` bound is checked against.
- ``s_post`` = v − ``group.finished_version``: how long the finished group waited.
- ``delta_gen`` = max − min token versions: versions spanned while generating (weights changed
  under a running episode).
- ``token_weighted`` = mean over sampled tokens of (v − token version).

A group whose sampled tokens carry no version at all has ``has_versions=False``: it is never
rejected for staleness, only counted (the coverage metric).

Admission control (``AdmissionControl``) keeps staleness bounded *before* generation instead
of discarding finished work: a group admitted now will be consumed by training step
``floor(consumable / groups_per_step)`` (counted from the control's base version), where
``consumable`` = groups admitted so far − groups dropped; it is admitted only if that step is
at most ``max_staleness`` versions ahead of the current one. This assumes one weight version
per training step (with fewer pushes it is conservative). Since long episodes are not
discarded at the door but simply wait for their slot, the bound no longer selects for short
trajectories; ``LengthBuckets`` makes any remaining bias visible.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from miles_engine.rollout.types import Group, Trajectory

DEFAULT_LENGTH_EDGES = (64, 256, 1024, 4096)


@dataclass(frozen=True)
class GroupStaleness:
    has_versions: bool
    s_old: int | None = None
    s_post: int | None = None
    delta_gen: int | None = None
    token_weighted: float | None = None
    versioned_tokens: int = 0
    sampled_tokens: int = 0


def group_staleness(group: Group, current_version: int) -> GroupStaleness:
    versions = [v for t in group.trajectories for v in t.sampled_versions]
    sampled = sum(t.num_sampled for t in group.trajectories)
    s_post = None if group.finished_version is None else current_version - group.finished_version
    if not versions:
        return GroupStaleness(False, s_post=s_post, sampled_tokens=sampled)
    lo, hi = min(versions), max(versions)
    weighted = sum(current_version - v for v in versions) / len(versions)
    return GroupStaleness(True, current_version - lo, s_post, hi - lo, weighted, len(versions), sampled)


class AdmissionControl:
    """Admit a new group only if its projected staleness at consumption stays within the bound.

    ``consumable`` returns the number of admitted groups that will (or did) reach training,
    i.e. admitted − dropped; the scheduler supplies it. ``base_version`` is the version at
    which counting started (admissions are counted from there too)."""

    def __init__(self, max_staleness: int, groups_per_step: int, base_version: int = 0) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        self.max_staleness = max_staleness
        self.groups_per_step = groups_per_step
        self.base_version = base_version
        self.holds = 0  # times admission went from open to closed
        self._open = True

    def projected_staleness(self, consumable: int, current_version: int) -> int:
        """Staleness (in versions) of the next group admitted now, when it is consumed."""
        consume_step = consumable // self.groups_per_step
        return consume_step - (current_version - self.base_version)

    def allows(self, consumable: int, current_version: int) -> bool:
        ok = self.projected_staleness(consumable, current_version) <= self.max_staleness
        if self._open and not ok:
            self.holds += 1
        self._open = ok
        return ok


def trajectory_length(t: Trajectory) -> int:
    """The length used for bucketing: sampled tokens (what generation time scales with)."""
    return t.num_sampled


class LengthBuckets:
    """Accepted / rejected trajectories by length bucket (``[0,e0) [e0,e1) … [ek,∞)``).

    A trajectory is *accepted* when its group reaches the trainer and it is still in it,
    *rejected* otherwise (with the reason of its group or its own failure)."""

    def __init__(self, edges: Sequence[int] = DEFAULT_LENGTH_EDGES,
                 length: Callable[[Trajectory], int] = trajectory_length) -> None:
        if list(edges) != sorted(set(edges)) or any(e <= 0 for e in edges):
            raise ValueError(f"length bucket edges must be strictly increasing positive ints, got {list(edges)}")
        self.edges = list(edges)
        self.length = length
        bounds = [0, *self.edges]
        self.labels = [f"{lo}-{hi}" for lo, hi in zip(bounds, self.edges)] + [f"{bounds[-1]}+"]
        self.accepted = [0] * len(self.labels)
        self.rejected = [0] * len(self.labels)

    def bucket(self, t: Trajectory) -> int:
        return bisect.bisect_right(self.edges, self.length(t))

    def record(self, trajectories: Sequence[Trajectory], accepted: bool) -> None:
        counts = self.accepted if accepted else self.rejected
        for t in trajectories:
            counts[self.bucket(t)] += 1

    def metrics(self, prefix: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for label, a, r in zip(self.labels, self.accepted, self.rejected):
            if a + r:
                out[f"{prefix}/acceptance/len_{label}"] = a / (a + r)
                out[f"{prefix}/trajectories/len_{label}"] = float(a + r)
        return out

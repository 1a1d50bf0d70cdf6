"""``AsyncBuffer``: a bounded queue of finished groups between the scheduler and the trainer.

- **put** (scheduler side) applies the put-time filters of :mod:`.filters` (failed and
  timed-out trajectories, the ``partial_failure`` policy, the user ``filter`` given by dotted
  path), then waits while the buffer is full (back-pressure).
- **get(n, current_version)** waits for ``n`` groups, evicting groups whose ``s_old`` exceeds
  ``max_staleness`` first (``stale``; with ``on_stale="keep"`` they are only counted), and
  takes the stalest groups first so that slow (long) groups are consumed before they expire.
  With ``wait_for_inflight`` (default) it also waits for every still-running group that would
  exceed the bound if it missed this step (the scheduler registers running groups with
  :meth:`track`); such a group may enter a full buffer. Together with the scheduler's admission
  control this bounds staleness without discarding the long episodes: the trainer waits for
  stragglers instead of racing ahead on short ones (``buffer/straggler_wait_s`` shows the cost).

Nothing is lost silently: every dropped group is counted by reason and logged, and its
trajectories count as rejected in the length-bucket acceptance metric.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_engine.errors import MilesError
from miles_engine.rollout.filters import (
    GroupFilter,
    RewardErrorPolicy,
    apply_failure_policy,
    failure_reason,
    user_filter_reason,
)
from miles_engine.rollout.staleness import DEFAULT_LENGTH_EDGES, GroupStaleness, LengthBuckets, group_staleness
from miles_engine.rollout.types import Group, Trajectory

log = logging.getLogger(__name__)
__all__ = ["AsyncBuffer", "BufferClosed", "BufferOptions", "GroupFilter", "failure_reason"]


class BufferOptions(BaseModel):
    """Options of the async buffer. Unknown keys are an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    capacity_groups: int = Field(64, ge=1, description="finished groups held at most; put waits beyond")
    max_staleness: int | None = Field(None, ge=0, description="largest s_old (versions) a taken group may have")
    on_stale: Literal["drop", "keep"] = Field("drop", description="what get does with a group over max_staleness")
    partial_failure: Literal["zero_reward", "drop_failed", "drop_group"] = "zero_reward"
    min_group_size: int = Field(2, ge=1, description="trajectories a group must keep after failure handling")
    filter: str | None = Field(None, description="dotted path of f(group) -> bool | (bool, reason)")
    length_buckets: tuple[int, ...] = Field(DEFAULT_LENGTH_EDGES, description="edges in sampled tokens")
    take_order: Literal["stalest_first", "fifo"] = "stalest_first"
    wait_for_inflight: bool = Field(True, description="get waits for running groups that would go stale")


class BufferClosed(MilesError):
    """The buffer was closed (the scheduler stopped or failed); the message says why."""


@dataclass
class _Entry:
    group: Group
    seq: int
    oldest: float  # oldest sampled-token version (inf when unversioned)


def _agg(values: Sequence[float], prefix: str) -> dict[str, float]:
    return {f"{prefix}_avg": sum(values) / len(values), f"{prefix}_max": float(max(values))} if values else {}


class AsyncBuffer:
    def __init__(self, options: BufferOptions | None = None, *, filter_fn: GroupFilter | None = None,
                 on_reward_error: RewardErrorPolicy = None) -> None:
        self.options = options or BufferOptions()
        self.on_reward_error = on_reward_error  # the recipe's reward.on_error (see filters)
        if filter_fn is None and self.options.filter:
            from miles_engine.loader import load_object

            filter_fn = load_object(self.options.filter)
            if not callable(filter_fn):
                raise MilesError(f"buffer filter {self.options.filter!r} is not callable")
        self._filter_fn = filter_fn
        self._queue: list[_Entry] = []
        self._cond = asyncio.Condition()
        self._seq = 0
        self._closed: str | None = None
        self.put_waiting = 0
        self.dropped: Counter[str] = Counter()
        self.failed_trajectories: Counter[str] = Counter()
        self.groups_put = 0
        self.groups_taken = 0
        self.groups_restored = 0  # put back from a checkpoint
        self.groups_evicted = 0  # left the queue without being taken (stale at get time)
        self.stale_kept = 0
        self.lengths = LengthBuckets(self.options.length_buckets)
        self._taken: list[GroupStaleness] = []
        self._coverage = Counter[str]()  # groups with / without versions, tokens versioned / sampled
        self.last_version: int | None = None
        self._inflight: dict[str, int] = {}  # running group id -> submitted version
        self._priority: set[str] = set()  # stragglers a get waits for: they may enter a full buffer
        self.straggler_wait_s = 0.0
        self._bg: set[asyncio.Task[None]] = set()
        # sees every trajectory that will not be trained on, with the reason (the run's trajectory record)
        self.on_drop: Callable[[Sequence[Trajectory], str], None] | None = None

    # ------------------------------------------------------------------ state
    def __len__(self) -> int:
        return len(self._queue)

    @property
    def capacity(self) -> int:
        return self.options.capacity_groups

    @property
    def full(self) -> bool:
        return len(self._queue) >= self.capacity

    @property
    def dropped_groups(self) -> int:
        return sum(self.dropped.values())

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def close(self, reason: str | BaseException = "buffer closed") -> None:
        """Wake every waiter: ``get`` and ``put`` raise :class:`BufferClosed` with ``reason``."""
        async with self._cond:
            if self._closed is None:
                self._closed = reason if isinstance(reason, str) else f"{type(reason).__name__}: {reason}"
            self._cond.notify_all()

    def track(self, group_id: str, submitted_version: int) -> None:
        """A group started running (the scheduler calls this); untracked once put or dropped."""
        self._inflight[group_id] = submitted_version

    def untrack(self, group_id: str) -> None:
        """A running group will never be put (cancelled): getters stop waiting for it."""
        if self._inflight.pop(group_id, None) is not None:
            task = asyncio.get_running_loop().create_task(self._notify())
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    def _stragglers(self, current_version: int) -> set[str]:
        bound = self.options.max_staleness
        if bound is None or not self.options.wait_for_inflight:
            return set()
        return {gid for gid, v in self._inflight.items() if current_version - v >= bound}

    def _drop(self, group: Group, reason: str, detail: str = "") -> None:
        self.dropped[reason] += 1
        self.lengths.record(group.trajectories, accepted=False)
        if self.on_drop is not None:
            self.on_drop(group.trajectories, reason)
        log.info("buffer: dropped group %s (task %s): %s%s", group.group_id, group.task_id, reason,
                 f" ({detail})" if detail else "")

    # ------------------------------------------------------------------ put
    async def put(self, group: Group) -> bool:
        """Filter ``group`` and enqueue it (waiting while full). ``False`` if it was dropped."""
        if self._closed is not None:
            raise BufferClosed(self._closed)
        verdict = apply_failure_policy(group, self.options.partial_failure, self.options.min_group_size,
                                       self.on_reward_error)
        self.failed_trajectories.update(verdict.failures)
        if verdict.removed:
            self.lengths.record(verdict.removed, accepted=False)
            if self.on_drop is not None:
                self.on_drop(verdict.removed, "removed_failed")
        reason = verdict.drop or user_filter_reason(self._filter_fn, group)
        if reason is not None:
            self._drop(group, reason)
            self.untrack(group.group_id)
            return False
        gid = group.group_id
        async with self._cond:
            self.put_waiting += 1
            try:
                await self._cond.wait_for(lambda: len(self._queue) < self.capacity or self._closed is not None
                                          or gid in self._priority)
            finally:
                self.put_waiting -= 1
            self._inflight.pop(gid, None)
            if self._closed is not None:
                self._drop(group, "closed")
                raise BufferClosed(self._closed)
            versions = [v for t in group.trajectories for v in t.sampled_versions]
            self._queue.append(_Entry(group, self._seq, min(versions) if versions else math.inf))
            self._seq += 1
            self.groups_put += 1
            self._cond.notify_all()
        return True

    # ------------------------------------------------------------------ checkpoint
    def snapshot(self) -> list[Group]:
        """The finished groups waiting to be taken, oldest put first (a checkpoint persists them)."""
        return [e.group for e in sorted(self._queue, key=lambda e: e.seq)]

    def restore(self, groups: Sequence[Group]) -> None:
        """Put back a checkpoint's groups as they were (already filtered; capacity not enforced)."""
        for group in groups:
            versions = [v for t in group.trajectories for v in t.sampled_versions]
            self._queue.append(_Entry(group, self._seq, min(versions) if versions else math.inf))
            self._seq += 1
            self.groups_restored += 1

    # ------------------------------------------------------------------ get
    def _evict_stale(self, current_version: int) -> None:
        bound = self.options.max_staleness
        if bound is None:
            return
        keep: list[_Entry] = []
        for e in self._queue:
            s_old = current_version - e.oldest if e.oldest != math.inf else None
            if s_old is not None and s_old > bound and self.options.on_stale == "drop":
                self._drop(e.group, "stale", f"s_old={s_old:g} > max_staleness={bound}")
                self.groups_evicted += 1
            else:
                keep.append(e)
        if len(keep) != len(self._queue):
            self._queue = keep
            self._cond.notify_all()

    async def get(self, n_groups: int, current_version: int, *, timeout: float | None = None) -> list[Group]:
        """Wait for ``n_groups`` groups fit to train at ``current_version`` and take them."""
        if not 1 <= n_groups <= self.capacity:
            raise ValueError(f"get({n_groups}): must be between 1 and the buffer capacity ({self.capacity})")
        self.last_version = current_version
        try:
            async with asyncio.timeout(timeout), self._cond:
                while True:
                    if self._closed is not None:
                        raise BufferClosed(self._closed)
                    self._evict_stale(current_version)
                    self._priority = self._stragglers(current_version)
                    if len(self._queue) >= n_groups and not self._priority:
                        break
                    if self._priority:
                        self._cond.notify_all()  # a straggler blocked on a full buffer may enter now
                    t = time.monotonic()
                    await self._cond.wait()
                    if self._priority:
                        self.straggler_wait_s += time.monotonic() - t
                order = sorted(self._queue, key=lambda e: (e.oldest, e.seq)) if \
                    self.options.take_order == "stalest_first" else self._queue
                taken = order[:n_groups]
                ids = {id(e) for e in taken}
                self._queue = [e for e in self._queue if id(e) not in ids]
                self._cond.notify_all()
        except TimeoutError:
            raise TimeoutError(f"buffer.get({n_groups}) timed out after {timeout}s with {len(self._queue)} "
                               f"groups buffered; dropped so far: {dict(self.dropped)}") from None
        finally:
            self._priority = set()
        groups = [e.group for e in sorted(taken, key=lambda e: e.seq)]
        self._record_taken(groups, current_version)
        return groups

    def _record_taken(self, groups: list[Group], current_version: int) -> None:
        self._taken = []
        bound = self.options.max_staleness
        for g in groups:
            s = group_staleness(g, current_version)
            self._taken.append(s)
            self._coverage["groups_with" if s.has_versions else "groups_without"] += 1
            self._coverage["tokens_versioned"] += s.versioned_tokens
            self._coverage["tokens_sampled"] += s.sampled_tokens
            if bound is not None and s.s_old is not None and s.s_old > bound:
                self.stale_kept += 1
            g.info["staleness"] = s
            self.lengths.record(g.trajectories, accepted=True)
        self.groups_taken += len(groups)

    # ------------------------------------------------------------------ metrics
    def metrics(self, current_version: int | None = None) -> dict[str, float]:
        """Flat metrics: queue, staleness of the last groups taken and of those still buffered
        (at ``current_version``, default: the last get's), drop counts by reason, coverage,
        acceptance by length bucket."""
        p = "buffer"
        out: dict[str, float] = {f"{p}/queue_size": float(len(self._queue)), f"{p}/capacity": float(self.capacity),
                                 f"{p}/put_waiting": float(self.put_waiting), f"{p}/groups_put": float(self.groups_put),
                                 f"{p}/groups_taken": float(self.groups_taken),
                                 f"{p}/groups_restored": float(self.groups_restored),
                                 f"{p}/groups_evicted": float(self.groups_evicted),
                                 f"{p}/dropped_total": float(self.dropped_groups),
                                 f"{p}/running_groups": float(len(self._inflight)),
                                 f"{p}/straggler_wait_s": self.straggler_wait_s}
        versioned = [s for s in self._taken if s.has_versions]
        out.update(_agg([s.s_old for s in versioned if s.s_old is not None], f"{p}/taken/s_old"))
        out.update(_agg([s.delta_gen for s in versioned if s.delta_gen is not None], f"{p}/taken/delta_gen"))
        out.update(_agg([s.token_weighted for s in versioned if s.token_weighted is not None],
                        f"{p}/taken/token_weighted"))
        out.update(_agg([s.s_post for s in self._taken if s.s_post is not None], f"{p}/taken/s_post"))
        version = self.last_version if current_version is None else current_version
        if version is not None:
            out.update(_agg([version - e.oldest for e in self._queue if e.oldest != math.inf], f"{p}/buffered/s_old"))
        for reason, n in self.dropped.items():
            out[f"{p}/dropped/{reason}"] = float(n)
        for reason, n in self.failed_trajectories.items():
            out[f"{p}/failed_trajectories/{reason}"] = float(n)
        c = self._coverage
        if c["groups_with"] + c["groups_without"]:
            out[f"{p}/version_coverage"] = c["groups_with"] / (c["groups_with"] + c["groups_without"])
            out[f"{p}/groups_without_versions"] = float(c["groups_without"])
        if c["tokens_sampled"]:
            out[f"{p}/token_version_coverage"] = c["tokens_versioned"] / c["tokens_sampled"]
        if self.options.max_staleness is not None:
            out[f"{p}/stale_kept"] = float(self.stale_kept)
        out.update(self.lengths.metrics(p))
        return out

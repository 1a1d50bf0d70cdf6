"""``Scheduler``: sample-granular refill of concurrent episodes into the async buffer.

A budget of ``max_inflight`` trajectory credits: every running episode holds one, every
finished episode (ok, failed, timed out) frees one, and a new group — ``group_size`` attempts
of the next task — is submitted as soon as ``group_size`` credits are free. So the number of
running episodes stays within ``group_size - 1`` of the budget however unequal episode lengths
are (a group-granular refill would idle until the slowest member of a group finished).

Only whole groups reach the buffer: a group is put when its last trajectory finishes, with
``finished_version`` set to the policy version at that moment. Episodes run through the
injected ``run_trajectory(task, attempt_index) -> Trajectory`` coroutine function (the driver's
runs a sandbox episode through TITO; tests use scripted ones) under a per-episode deadline:
a timeout becomes a trajectory with status ``"timeout"``, an exception one with status
``"failed"`` and the error text — never a crashed batch. Cancellation (deadline or
:meth:`stop`) reaches the episode coroutine, whose own ``finally`` closes its sandbox.

Submission also waits while paused (:meth:`pause`; :meth:`retract` also puts the groups still
generating back in the queue, e.g. while the engines evaluate), while a finished group is blocked on a
full buffer (back-pressure), and while the ``gate`` callable (set by a rollout mode: phase
quotas, admission control) says no.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from miles_engine.rollout.buffer import AsyncBuffer, BufferClosed
from miles_engine.rollout.types import Group, Trajectory

log = logging.getLogger(__name__)
RunTrajectory = Callable[[Any, int], Awaitable[Trajectory]]


class SchedulerOptions(BaseModel):
    """The scheduler's options; the recipe's ``rollout`` section extends this model (one set of
    defaults, one key per knob), so errors name ``rollout.*``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    group_size: int = Field(8, ge=1, description="attempts per task (GRPO's n)")
    max_inflight: int = Field(32, ge=1, description="trajectory credits: episodes running at once")
    episode_timeout_s: float | None = Field(120.0, gt=0, description="deadline of one episode (None: none)")
    poll_s: float = Field(0.05, gt=0, description="how often a closed gate is re-checked without a notify")

    @model_validator(mode="after")
    def _a_group_fits(self) -> SchedulerOptions:
        if self.max_inflight < self.group_size:
            raise ValueError(f"max_inflight ({self.max_inflight}) must be >= group_size ({self.group_size}): a group "
                             f"needs that many credits to be submitted")
        return self


@dataclass
class _GroupRun:
    group_id: str
    position: int  # index of its task in the task stream: group ids are ``task_id@position``
    task: Any
    task_id: str
    submitted_version: int
    trajectories: list[Trajectory | None]
    remaining: int
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    retracted: bool = False  # put back in the queue: whatever its episodes still return is dropped


def _task_id(task: Any) -> str:
    return str(getattr(task, "id", task))


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Scheduler:
    def __init__(self, tasks: Iterable[Any], run_trajectory: RunTrajectory, buffer: AsyncBuffer,
                 options: SchedulerOptions | None = None, *, version_fn: Callable[[], int] = lambda: 0,
                 first_position: int = 0, requeue: Iterable[tuple[int, Any]] = ()) -> None:
        """``tasks`` is the stream from its ``first_position`` on; ``requeue`` holds ``(position,
        task)`` of groups a checkpoint recorded as running: they are submitted first, with the
        same group ids (a resumed run regenerates them instead of losing them)."""
        self.options = options or SchedulerOptions()
        self._tasks = iter(tasks)
        self._run = run_trajectory
        self.buffer = buffer
        self.version_fn = version_fn
        self.gate: Callable[[], bool] | None = None
        self._groups: dict[str, _GroupRun] = {}
        self.next_position = first_position  # the data cursor: stream position of the next new task
        self._requeue = collections.deque(requeue)
        self._wake = asyncio.Event()  # the submission loop's
        self._progress = asyncio.Event()  # wait_idle's
        self._loop_task: asyncio.Task[None] | None = None
        self._paused = False
        self._stopping = False
        self.exhausted = False
        self.error: BaseException | None = None
        self.inflight = 0
        self.pending_puts = 0
        self.counts: Counter[str] = Counter()
        self.blocked_s: Counter[str] = Counter()
        self._episode_n = 0
        self._episode_sum = 0.0
        self._episode_max = 0.0
        self._area = 0.0
        self._t0 = self._t_last = time.monotonic()

    # ------------------------------------------------------------------ control
    async def start(self) -> Scheduler:
        if self._loop_task is None:
            self._t0 = self._t_last = time.monotonic()
            self._loop_task = asyncio.create_task(self._loop(), name="rollout-scheduler")
        return self

    def pause(self) -> None:
        """Stop submitting new groups (running episodes continue)."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self.notify()

    @property
    def paused(self) -> bool:
        return self._paused

    async def retract(self) -> int:
        """Cancel every group still generating (their sandboxes close) and put it back at the
        front of the queue under the same group id, to be generated again when submission
        resumes; groups already finished (entering the buffer) are left alone. Returns how many
        were retracted. A retracted group no longer counts as submitted, so phase quotas and
        admission control see it once."""
        running = sorted((r for r in self._groups.values() if r.remaining > 0), key=lambda r: r.position)
        tasks = [t for r in running for t in r.tasks]
        for r in running:
            r.retracted = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for r in running:
            self._groups.pop(r.group_id, None)
            self.buffer.untrack(r.group_id)
        self._requeue.extendleft((r.position, r.task) for r in reversed(running))
        self.counts["submitted_groups"] -= len(running)
        self.counts["groups_retracted"] += len(running)
        self.counts["trajectories_retracted"] += sum(r.remaining for r in running)
        if running:
            log.info("scheduler: %d running group(s) retracted, to be generated again", len(running))
        return len(running)

    def notify(self) -> None:
        """Re-check the submission conditions now (e.g. after a weight push opened the gate)."""
        self._wake.set()
        self._progress.set()

    async def stop(self, *, close_buffer: bool = True) -> None:
        """Stop submitting, cancel every running episode (their own ``finally`` blocks close
        the sandboxes) and count the unfinished groups as ``groups_cancelled``."""
        self._stopping = True
        self.notify()
        running = [t for g in self._groups.values() for t in g.tasks]
        if self._loop_task is not None:
            running.append(self._loop_task)
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if self._groups:
            self.counts["groups_cancelled"] += len(self._groups)
            for gid in self._groups:
                self.buffer.untrack(gid)
            log.info("scheduler: stopped with %d unfinished groups cancelled", len(self._groups))
            self._groups.clear()
        if close_buffer:
            await self.buffer.close("the rollout scheduler was stopped")

    async def wait_idle(self, timeout: float | None = None) -> None:
        """Wait until no episode runs and no group waits to enter the buffer."""
        async with asyncio.timeout(timeout):
            while self.inflight or self.pending_puts:
                self._progress.clear()
                await self._wait_wake(self._progress)

    # ------------------------------------------------------------------ submission loop
    def _blocker(self) -> str | None:
        if self._paused:
            return "paused"
        if self.pending_puts:
            return "backpressure"
        if self.options.max_inflight - self.inflight < self.options.group_size:
            return "credits"
        if self.gate is not None and not self.gate():
            return "gate"
        return None

    async def _wait_wake(self, event: asyncio.Event | None = None) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.options.poll_s):
                await (event or self._wake).wait()

    async def _loop(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                blocker = self._blocker()
                if blocker is not None:
                    t = time.monotonic()
                    await self._wait_wake()
                    self.blocked_s[blocker] += time.monotonic() - t
                    continue
                if self._requeue:
                    position, task = self._requeue.popleft()
                else:
                    try:
                        task = next(self._tasks)
                    except StopIteration:
                        self.exhausted = True
                        log.info("scheduler: the task stream is exhausted")
                        return
                    position, self.next_position = self.next_position, self.next_position + 1
                self._submit(task, position)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - surfaced to the trainer through the buffer
            self.error = exc
            log.exception("scheduler: submission loop failed")
            await self.buffer.close(exc)

    def _submit(self, task: Any, position: int) -> None:
        n = self.options.group_size
        task_id = _task_id(task)
        run = _GroupRun(f"{task_id}@{position}", position, task, task_id, self.version_fn(), [None] * n, n)
        self._groups[run.group_id] = run
        self.buffer.track(run.group_id, run.submitted_version)
        self._set_inflight(self.inflight + n)
        self.counts["submitted_groups"] += 1
        self.counts["submitted_trajectories"] += n
        for i in range(n):
            t = asyncio.create_task(self._episode(run, i), name=f"episode-{run.group_id}-{i}")
            run.tasks.add(t)
            t.add_done_callback(run.tasks.discard)

    def unfinished(self) -> list[tuple[int, str]]:
        """``(position, task_id)`` of every group submitted (or due for resubmission) but not yet
        in the buffer: what a checkpoint requeues."""
        running = [(r.position, r.task_id) for r in self._groups.values()]
        return sorted(running + [(p, _task_id(t)) for p, t in self._requeue])

    @property
    def submitted_groups(self) -> int:
        return self.counts["submitted_groups"]

    def _set_inflight(self, value: int) -> None:
        now = time.monotonic()
        self._area += self.inflight * (now - self._t_last)
        self._t_last, self.inflight = now, value

    # ------------------------------------------------------------------ one episode
    def _failed(self, run: _GroupRun, index: int, status: str, error: str) -> Trajectory:
        return Trajectory([], [], [], [], status=status, error=error, task_id=run.task_id,  # type: ignore[arg-type]
                          group_id=run.group_id, index=index)

    async def _attempt(self, run: _GroupRun, index: int) -> Trajectory:
        limit = self.options.episode_timeout_s
        cm = asyncio.timeout(limit)
        try:
            async with cm:
                traj = await self._run(run.task, index)
        except TimeoutError as exc:
            if cm.expired():
                self.counts["timeouts"] += 1
                return self._failed(run, index, "timeout", f"episode exceeded its deadline of {limit:g}s")
            return self._failed(run, index, "failed", _describe(exc))
        except Exception as exc:  # noqa: BLE001 - an episode's error is a failed sample, never a crash
            log.debug("episode %s#%d raised", run.group_id, index, exc_info=True)
            return self._failed(run, index, "failed", _describe(exc))
        if not isinstance(traj, Trajectory):
            return self._failed(run, index, "failed", f"run_trajectory returned {type(traj).__name__}, "
                                                      f"not a Trajectory")
        traj.task_id = traj.task_id or run.task_id
        traj.group_id, traj.index = run.group_id, index
        return traj

    async def _episode(self, run: _GroupRun, index: int) -> None:
        started = time.monotonic()
        try:
            traj = await self._attempt(run, index)
        finally:
            self._set_inflight(self.inflight - 1)
            self.notify()
        elapsed = time.monotonic() - started
        self._episode_n += 1
        self._episode_sum += elapsed
        self._episode_max = max(self._episode_max, elapsed)
        self.counts["finished_trajectories"] += 1
        if traj.status != "ok":
            self.counts["failed_trajectories"] += 1
        if run.retracted:  # an episode that swallowed its cancellation: the group runs again from scratch
            return
        run.trajectories[index] = traj
        run.remaining -= 1
        if run.remaining == 0:
            await self._complete(run)

    async def _complete(self, run: _GroupRun) -> None:
        group = Group(run.group_id, run.task_id, [t for t in run.trajectories if t is not None],
                      submitted_version=run.submitted_version, finished_version=self.version_fn())
        self.pending_puts += 1
        try:
            if await self.buffer.put(group):
                self.counts["groups_put"] += 1
            else:
                self.counts["groups_filtered"] += 1
        except BufferClosed:
            self.counts["groups_discarded_closed"] += 1
            log.info("scheduler: group %s finished after the buffer closed; discarded", run.group_id)
        except asyncio.CancelledError:
            self.counts["groups_cancelled"] += 1
            self.buffer.untrack(run.group_id)
            log.info("scheduler: group %s cancelled while waiting for buffer space", run.group_id)
            raise
        finally:
            self.pending_puts -= 1
            self._groups.pop(run.group_id, None)
            self.notify()

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, float]:
        self._set_inflight(self.inflight)
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        p = "scheduler"
        out = {f"{p}/inflight": float(self.inflight), f"{p}/max_inflight": float(self.options.max_inflight),
               f"{p}/inflight_avg": self._area / elapsed, f"{p}/paused": float(self._paused)}
        out.update({f"{p}/{k}": float(v) for k, v in self.counts.items()})
        out.update({f"{p}/blocked_s/{k}": v for k, v in self.blocked_s.items()})
        if self._episode_n:
            out[f"{p}/episode_time_avg"] = self._episode_sum / self._episode_n
            out[f"{p}/episode_time_max"] = self._episode_max
        return out

"""Scheduler: sample-granular credit refill, whole groups, deadlines, errors, pause, stop, task stream."""

from __future__ import annotations

import asyncio
import random

import pytest
from pydantic import ValidationError

from miles_engine.config.recipe import load_recipe
from miles_engine.environments.protocol import TaskRef
from miles_engine.errors import ConfigError
from miles_engine.hub import default_hub
from miles_engine.rollout.buffer import AsyncBuffer, BufferClosed, BufferOptions
from miles_engine.rollout.scheduler import Scheduler, SchedulerOptions
from miles_engine.rollout.tasks import TaskStream
from tests.rollout.helpers import run, traj


def _tasks(n: int = 1000):
    return (f"task{i}" for i in range(n))


def test_credit_refill_keeps_inflight_near_budget_with_tenfold_length_spread():
    budget, n = 16, 4
    rng = random.Random(0)
    durations: dict[tuple[str, int], float] = {}

    async def run_trajectory(task, attempt):
        d = durations.setdefault((task, attempt), rng.choice([0.01, 0.1]))  # 10x spread, also inside groups
        await asyncio.sleep(d)
        return traj([0] * (10 if d > 0.05 else 1))

    async def main():
        buf = AsyncBuffer(BufferOptions(capacity_groups=64))
        sched = Scheduler(_tasks(), run_trajectory, buf, SchedulerOptions(group_size=n, max_inflight=budget))
        samples, seen = [], []

        async def consume():
            while True:
                for g in await buf.get(1, 0):
                    seen.append(g)
        consumer = asyncio.create_task(consume())
        await sched.start()
        for _ in range(60):  # ~1.2 s
            await asyncio.sleep(0.02)
            samples.append(sched.inflight)
            assert sched.inflight <= budget
        m = sched.metrics()
        await sched.stop()
        consumer.cancel()
        return m, samples, seen
    m, samples, seen = run(main())
    # sample-granular refill: at most n-1 credits idle, apart from the instant between episodes
    # finishing and the submission loop running again
    steady = sorted(samples[2:])
    assert steady[len(steady) // 2] >= budget - n + 1, samples
    assert m["scheduler/inflight_avg"] >= 0.8 * budget, m
    assert len(seen) >= 20
    for g in seen:  # whole groups only
        assert len(g.trajectories) == n and [t.index for t in g.trajectories] == list(range(n))
        assert {t.group_id for t in g.trajectories} == {g.group_id}
        assert {t.task_id for t in g.trajectories} == {g.task_id}


def test_timeouts_and_exceptions_become_failed_trajectories_and_close_sandboxes():
    closed: list[tuple[str, int]] = []

    async def run_trajectory(task, attempt):
        try:
            if attempt == 1:
                raise RuntimeError("sandbox exploded")
            if attempt == 2:
                await asyncio.sleep(30)
            if attempt == 3:
                return "not a trajectory"
            return traj([0, 0])
        finally:
            closed.append((task, attempt))  # the episode's own finally (closing its sandbox) runs

    async def main():
        buf = AsyncBuffer(BufferOptions(partial_failure="drop_failed", min_group_size=1))
        sched = Scheduler(_tasks(1), run_trajectory, buf,
                          SchedulerOptions(group_size=4, max_inflight=4, episode_timeout_s=0.2))
        await sched.start()
        [g] = await buf.get(1, 0, timeout=5)
        await sched.wait_idle(timeout=2)
        return g, sched
    g, sched = run(main())
    assert len(g.trajectories) == 1 and g.info["removed_failed"] == 3
    assert sorted(closed) == [("task0", i) for i in range(4)]
    m = sched.metrics()
    assert m["scheduler/timeouts"] == 1 and m["scheduler/failed_trajectories"] == 3
    assert m["scheduler/finished_trajectories"] == 4 and sched.exhausted
    fails = sched.buffer.failed_trajectories
    assert fails == {"failed": 2, "timeout": 1}


def test_error_text_and_status_of_failed_trajectories():
    async def run_trajectory(task, attempt):
        if attempt == 0:
            raise ValueError("no such file: /x")
        await asyncio.sleep(10)

    async def main():
        got = []

        class Spy(AsyncBuffer):
            async def put(self, group):
                got.append(group)
                return await super().put(group)
        buf = Spy()
        sched = Scheduler(_tasks(1), run_trajectory, buf, SchedulerOptions(group_size=2, max_inflight=2,
                                                                           episode_timeout_s=0.1))
        await sched.start()
        while not sched.exhausted:
            await asyncio.sleep(0.01)
        await sched.wait_idle(timeout=3)
        return got, buf
    got, buf = run(main())
    [g] = got
    a, b = g.trajectories
    assert a.status == "failed" and a.error == "ValueError: no such file: /x"
    assert b.status == "timeout" and "deadline of 0.1s" in b.error
    assert buf.dropped == {"all_failed": 1}


def test_backpressure_stops_submission_and_pause_resume():
    async def run_trajectory(task, attempt):
        await asyncio.sleep(0.005)
        return traj([0])

    async def main():
        buf = AsyncBuffer(BufferOptions(capacity_groups=2))
        sched = Scheduler(_tasks(), run_trajectory, buf, SchedulerOptions(group_size=2, max_inflight=8))
        await sched.start()
        await asyncio.sleep(0.3)
        # buffer full, one group blocked in put, nothing else submitted meanwhile
        assert len(buf) == 2 and sched.pending_puts >= 1
        submitted = sched.submitted_groups
        assert submitted <= 2 + 1 + 4  # full buffer + the blocked group + one budget's worth
        await asyncio.sleep(0.1)
        assert sched.submitted_groups == submitted
        assert sched.metrics()["scheduler/blocked_s/backpressure"] > 0
        sched.pause()
        await buf.get(2, 0)
        await asyncio.sleep(0.1)
        await sched.wait_idle(timeout=1)
        paused_at = sched.submitted_groups
        await asyncio.sleep(0.1)
        assert sched.submitted_groups == paused_at  # paused: nothing new
        assert len(buf) == 2  # the groups blocked before the pause got in
        sched.resume()
        await buf.get(2, 0, timeout=2)
        await buf.get(2, 0, timeout=2)  # needs new submissions
        assert sched.submitted_groups > paused_at
        await sched.stop()
    run(main())


def test_stop_cancels_running_episodes_and_closes_the_buffer():
    finally_ran = []

    async def run_trajectory(task, attempt):
        try:
            await asyncio.sleep(30)
        finally:
            finally_ran.append(attempt)

    async def main():
        buf = AsyncBuffer()
        sched = Scheduler(_tasks(), run_trajectory, buf, SchedulerOptions(group_size=2, max_inflight=6))
        await sched.start()
        await asyncio.sleep(0.05)
        assert sched.inflight == 6
        await sched.stop()
        assert sched.inflight == 0 and sched.counts["groups_cancelled"] == 3
        with pytest.raises(BufferClosed, match="stopped"):
            await buf.get(1, 0)
    run(main())
    assert len(finally_ran) == 6


def test_task_stream_failure_surfaces_through_the_buffer():
    def tasks():
        yield "ok"
        raise KeyError("task store vanished")

    async def run_trajectory(task, attempt):
        return traj([0])

    async def main():
        buf = AsyncBuffer()
        sched = Scheduler(tasks(), run_trajectory, buf, SchedulerOptions(group_size=2, max_inflight=4))
        await sched.start()
        with pytest.raises(BufferClosed, match="task store vanished"):
            for _ in range(3):
                await buf.get(1, 0, timeout=2)
        assert isinstance(sched.error, KeyError)
    run(main())


def test_budget_smaller_than_a_group_is_a_config_error(tmp_path):
    with pytest.raises(ValidationError, match="max_inflight"):
        SchedulerOptions(group_size=8, max_inflight=4)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("environment: {name: shell-drills}\nrollout:\n  group_size: 8\n  max_inflight: 4\n")
    with pytest.raises(ConfigError, match=r"r.yaml:2: bad value for 'rollout'.*max_inflight \(4\) must be >= "
                                          r"group_size \(8\)"):
        load_recipe(str(recipe), hub=default_hub())


class _Source:
    name = "toy"

    def __init__(self, ids):
        self.ids = ids

    def list_tasks(self):
        return iter(TaskRef(id=i, tags=("hard",) if i.endswith("9") else ()) for i in self.ids)


def test_task_stream_cycles_with_seeded_shuffle_and_refuses_empty_sets():
    src = _Source([f"t{i}" for i in range(10)])
    a = TaskStream(src, seed=3)
    first = [r.id for _, r in zip(range(30), a)]
    again = [r.id for _, r in zip(range(30), TaskStream(src, seed=3))]
    assert first == again and sorted(first[:10]) == sorted(src.ids) and first[:10] != first[10:20]
    assert [r.id for r in TaskStream(src, shuffle=False, epochs=1)] == src.ids
    hard = TaskStream(src, task_filter=lambda r: "hard" in r.tags, epochs=2)
    assert [r.id for r in hard] == ["t9", "t9"]
    with pytest.raises(ConfigError, match="none is left after filtering"):
        TaskStream(src, task_filter=lambda r: False)
    with pytest.raises(ConfigError, match="lists no tasks"):
        TaskStream(_Source([]))
    with pytest.raises(ConfigError, match="no task"):
        TaskStream(src, task_ids=["t1", "nope"])


def test_retract_requeues_running_groups_under_their_ids_and_the_phase_quota_sees_them_once():
    """What shared evaluation does under fully_async (eval.in_flight: retract): pause, retract the
    groups still generating (their episodes are cancelled and clean up), evaluate, resume: each
    retracted group runs again from scratch under the same group id, none is lost or doubled."""
    from miles_engine.rollout.modes import SyncMode

    release = asyncio.Event()
    started: list[tuple[str, int]] = []
    cleaned: list[tuple[str, int]] = []

    async def run_trajectory(task, attempt):
        started.append((task, attempt))
        try:
            if attempt == 1:  # attempt 0 finishes at once: a retracted group may be part done
                await release.wait()
            return traj([0], reward=float(attempt))
        finally:
            cleaned.append((task, attempt))

    async def main():
        buf = AsyncBuffer(BufferOptions(capacity_groups=8))
        sched = Scheduler(_tasks(), run_trajectory, buf, SchedulerOptions(group_size=2, max_inflight=4))
        mode = SyncMode(sched, groups_per_step=3)
        await mode.start()
        for _ in range(1000):  # two groups fit the credits: both submitted, their attempt 1 blocked
            if len(started) == 4 and sched.inflight == 2:
                break
            await asyncio.sleep(0)
        assert sorted(started) == [("task0", 0), ("task0", 1), ("task1", 0), ("task1", 1)]
        sched.pause()
        assert await sched.retract() == 2
        assert sched.inflight == 0 and len(buf) == 0 and sched.unfinished() == [(0, "task0"), (1, "task1")]
        assert ("task0", 1) in cleaned and ("task1", 1) in cleaned  # cancelled episodes ran their cleanup
        m = sched.metrics()
        assert m["scheduler/groups_retracted"] == 2 and m["scheduler/trajectories_retracted"] == 2
        assert m["scheduler/submitted_groups"] == 0
        assert await sched.retract() == 0  # nothing left running
        release.set()
        sched.resume()
        groups = await buf.get(3, 0, timeout=5)
        assert [g.group_id for g in groups] == ["task0@0", "task1@1", "task2@2"]
        assert all(sorted(t.reward for t in g.trajectories) == [0.0, 1.0] for g in groups)
        for _ in range(20):
            await asyncio.sleep(0)
        assert sched.submitted_groups == 3 and len(buf) == 0  # the phase quota counted each group once
        await mode.stop()
    run(main())

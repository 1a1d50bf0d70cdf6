"""AsyncBuffer: back-pressure, put-time filters with counts, failure policies, user filter."""

from __future__ import annotations

import asyncio
import importlib
import logging
import textwrap

import pytest

from miles_engine.errors import ConfigError
from miles_engine.rollout.buffer import AsyncBuffer, BufferClosed, BufferOptions
from tests.rollout.helpers import group, run, traj


def test_back_pressure_put_waits_until_get_frees_space():
    async def main():
        buf = AsyncBuffer(BufferOptions(capacity_groups=2))
        assert await buf.put(group([traj(), traj()], gid="a"))
        assert await buf.put(group([traj(), traj()], gid="b"))
        third = asyncio.create_task(buf.put(group([traj(), traj()], gid="c")))
        await asyncio.sleep(0.05)
        assert not third.done() and buf.put_waiting == 1 and buf.full
        assert buf.metrics()["buffer/put_waiting"] == 1
        got = await buf.get(1, current_version=0)
        assert [g.group_id for g in got] == ["a"]
        assert await asyncio.wait_for(third, 1.0) is True
        assert [g.group_id for g in await buf.get(2, 0)] == ["b", "c"]
    run(main())


def test_get_waits_for_enough_groups_and_checks_n():
    async def main():
        buf = AsyncBuffer(BufferOptions(capacity_groups=3))
        with pytest.raises(ValueError, match="capacity"):
            await buf.get(4, 0)
        getter = asyncio.create_task(buf.get(2, 0))
        await buf.put(group([traj(), traj()], gid="a"))
        await asyncio.sleep(0.02)
        assert not getter.done()
        await buf.put(group([traj(), traj()], gid="b"))
        assert len(await asyncio.wait_for(getter, 1.0)) == 2
    run(main())


def test_close_wakes_getters_and_putters():
    async def main():
        buf = AsyncBuffer(BufferOptions(capacity_groups=1))
        await buf.put(group([traj(), traj()], gid="a"))
        putter = asyncio.create_task(buf.put(group([traj(), traj()], gid="b")))
        await asyncio.sleep(0.01)
        await buf.close(RuntimeError("scheduler died"))
        with pytest.raises(BufferClosed, match="scheduler died"):
            await putter
        with pytest.raises(BufferClosed, match="scheduler died"):
            await buf.get(1, 0)
        assert buf.dropped["closed"] == 1
    run(main())


def _failures():
    """One group per case: (group, expected kept trajectory count or None when dropped, reason)."""
    return [
        (group([traj(status="failed"), traj(status="timeout")], gid="allfail"), None, "all_failed"),
        (group([traj(reward=None), traj(reward=float("nan"))], gid="noreward"), None, "all_failed"),
        (group([traj(), traj(), traj(status="timeout")], gid="onetimeout"), 3, None),
        (group([traj(), traj(status="failed", tokens=0)], gid="tokenless"), None, "too_few_ok"),
        (group([traj(), traj(), traj(status="failed", tokens=0)], gid="tokenless3"), 2, None),
    ]


def test_zero_reward_policy_keeps_failed_attempts_with_tokens_at_reward_zero(caplog):
    async def main():
        buf = AsyncBuffer(BufferOptions(capacity_groups=8, partial_failure="zero_reward"))
        for g, kept, reason in _failures():
            assert await buf.put(g) is (kept is not None), g.group_id
            if kept is not None:
                assert len(g.trajectories) == kept
        got = {g.group_id: g for g in await buf.get(2, 0)}
        timed_out = got["onetimeout"].trajectories[2]
        assert timed_out.reward == 0.0 and timed_out.tags["failure"] == "timeout"
        assert got["tokenless3"].info["removed_failed"] == 1
        return buf
    with caplog.at_level(logging.INFO, logger="miles_engine.rollout.buffer"):
        buf = run(main())
    assert buf.dropped == {"all_failed": 2, "too_few_ok": 1}
    m = buf.metrics()
    assert m["buffer/dropped/all_failed"] == 2 and m["buffer/dropped_total"] == 3
    assert m["buffer/failed_trajectories/timeout"] == 2 and m["buffer/failed_trajectories/no_reward"] == 2
    assert m["buffer/failed_trajectories/failed"] == 3
    assert sum("dropped group" in r.message for r in caplog.records) == 3  # every drop is logged


def test_drop_failed_and_drop_group_policies():
    async def main(policy):
        buf = AsyncBuffer(BufferOptions(capacity_groups=8, partial_failure=policy, min_group_size=2))
        results = {}
        for g in [group([traj(), traj(), traj(status="timeout")], gid="three"),
                  group([traj(), traj(status="aborted")], gid="two")]:
            results[g.group_id] = (await buf.put(g), len(g.trajectories))
        return results, dict(buf.dropped)
    results, dropped = run(main("drop_failed"))
    assert results == {"three": (True, 2), "two": (False, 2)} and dropped == {"too_few_ok": 1}
    results, dropped = run(main("drop_group"))
    assert results["three"][0] is False and dropped == {"partial_failure": 2}


def test_user_filter_by_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "my_buffer_filters.py").write_text(textwrap.dedent("""
        def keep_mixed(group):
            rewards = {t.reward for t in group.trajectories}
            return (len(rewards) > 1, "uniform_reward")
        def broken(group):
            raise RuntimeError("bug")
        not_callable = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()

    async def main(path):
        buf = AsyncBuffer(BufferOptions(filter=path))
        await buf.put(group([traj(reward=1.0), traj(reward=1.0)], gid="same"))
        await buf.put(group([traj(reward=1.0), traj(reward=0.0)], gid="mixed"))
        return buf
    buf = run(main("my_buffer_filters:keep_mixed"))
    assert dict(buf.dropped) == {"user:uniform_reward": 1} and len(buf) == 1
    buf = run(main("my_buffer_filters.broken"))
    assert dict(buf.dropped) == {"user_filter_error": 2}
    with pytest.raises(ConfigError, match="no attribute"):
        AsyncBuffer(BufferOptions(filter="my_buffer_filters:missing"))
    with pytest.raises(Exception, match="not callable"):
        AsyncBuffer(BufferOptions(filter="my_buffer_filters:not_callable"))


def test_stale_groups_dropped_at_get_or_kept_and_counted():
    async def main(on_stale):
        buf = AsyncBuffer(BufferOptions(capacity_groups=4, max_staleness=1, on_stale=on_stale, length_buckets=(3,)))
        await buf.put(group([traj([0, 0, 0, 0]), traj([0, 1, 1, 1])], gid="long"))  # s_old 3 at v3
        await buf.put(group([traj([2]), traj([2])], gid="short"))
        await buf.put(group([traj([3]), traj([3])], gid="short2"))
        got = await buf.get(2, current_version=3)
        return [g.group_id for g in got], buf
    ids, buf = run(main("drop"))
    assert ids == ["short", "short2"] and buf.dropped == {"stale": 1}
    m = buf.metrics()
    assert m["buffer/acceptance/len_3+"] == 0.0 and m["buffer/acceptance/len_0-3"] == 1.0  # the bias is visible
    ids, buf = run(main("keep"))
    assert ids == ["long", "short"] and not buf.dropped and buf.metrics()["buffer/stale_kept"] == 1


def test_get_waits_for_running_groups_that_would_go_stale_even_into_a_full_buffer():
    async def main():
        buf = AsyncBuffer(BufferOptions(capacity_groups=1, max_staleness=1))
        buf.track("slow", 0)  # submitted at version 0, still running
        buf.track("later", 1)
        await buf.put(group([traj([1]), traj([1])], gid="fast"))  # the buffer is now full
        getter = asyncio.create_task(buf.get(1, current_version=1))
        await asyncio.sleep(0.05)
        assert not getter.done()  # at version 2 "slow" would be 2 stale: the trainer waits for it
        assert buf.metrics()["buffer/running_groups"] == 2
        await asyncio.wait_for(buf.put(group([traj([0]), traj([1])], gid="slow")), 1.0)  # enters a full buffer
        got = await asyncio.wait_for(getter, 1.0)
        assert [g.group_id for g in got] == ["slow"] and got[0].info["staleness"].s_old == 1
        assert buf.metrics()["buffer/straggler_wait_s"] > 0
        # a cancelled running group is forgotten: nobody waits for it
        buf.track("doomed", 1)
        getter = asyncio.create_task(buf.get(1, current_version=2))
        await asyncio.sleep(0.05)
        assert not getter.done()
        buf.untrack("doomed")
        buf.untrack("later")
        assert [g.group_id for g in await asyncio.wait_for(getter, 1.0)] == ["fast"]
    run(main())

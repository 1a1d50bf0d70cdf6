"""Staleness accounting on a scripted version timeline, admission arithmetic, length buckets."""

from __future__ import annotations

import pytest

from miles_engine.rollout.buffer import AsyncBuffer, BufferOptions
from miles_engine.rollout.staleness import AdmissionControl, LengthBuckets, group_staleness
from tests.rollout.helpers import group, run, traj, versions_at

# pushes land at t=2 (v1), t=5 (v2), t=7 (v3); the trainer takes the group at t=8 (current = 3)
PUSHES = [2, 5, 7]


def _timeline_group():
    a = traj(versions_at([0, 1, 3, 4], PUSHES), env=3)  # [0, 0, 1, 1]
    b = traj(versions_at([1, 2, 6], PUSHES))  # [0, 1, 2]
    assert a.sampled_versions == [0, 0, 1, 1] and b.sampled_versions == [0, 1, 2]
    finished = versions_at([6], PUSHES)[0]  # the group's last token at t=6: version 2
    return group([a, b], finished=finished)


def test_staleness_by_hand_on_a_scripted_timeline():
    s = group_staleness(_timeline_group(), current_version=3)
    assert s.has_versions
    assert s.s_old == 3 - 0  # oldest sampled token was produced by version 0
    assert s.s_post == 3 - 2  # finished under version 2
    assert s.delta_gen == 2 - 0  # generation spanned versions 0..2
    # per token: a: 3,3,2,2  b: 3,2,1  -> 16 / 7
    assert s.token_weighted == pytest.approx(16 / 7)
    assert s.versioned_tokens == 7 and s.sampled_tokens == 7


def test_buffer_reports_the_same_values_and_buffered_staleness():
    async def main():
        buf = AsyncBuffer(BufferOptions(capacity_groups=4))
        await buf.put(_timeline_group())
        await buf.put(group([traj([2, 3]), traj([3])], gid="h", finished=3))
        m = buf.metrics(current_version=3)
        assert m["buffer/buffered/s_old_max"] == 3 and m["buffer/buffered/s_old_avg"] == pytest.approx((3 + 1) / 2)
        taken = await buf.get(1, current_version=3)
        assert taken[0].group_id == "g"  # stalest first
        m = buf.metrics()
        assert m["buffer/taken/s_old_max"] == 3 and m["buffer/taken/s_post_max"] == 1
        assert m["buffer/taken/delta_gen_max"] == 2
        assert m["buffer/taken/token_weighted_avg"] == pytest.approx(16 / 7)
        assert taken[0].info["staleness"].s_old == 3
    run(main())


def test_groups_without_versions_are_never_rejected_but_counted():
    async def main():
        buf = AsyncBuffer(BufferOptions(capacity_groups=4, max_staleness=0))
        await buf.put(group([traj(tokens=3), traj(tokens=2)], gid="nov"))
        await buf.put(group([traj([5]), traj([5])], gid="old"))
        with pytest.raises(TimeoutError):  # "old" is 4 versions stale: dropped; "nov" alone is not 2
            await buf.get(2, current_version=9, timeout=0.2)
        assert buf.dropped["stale"] == 1 and len(buf) == 1
        await buf.put(group([traj([9]), traj([9])], gid="new"))
        got = await buf.get(2, current_version=9)
        assert {g.group_id for g in got} == {"nov", "new"}
        m = buf.metrics()
        assert m["buffer/version_coverage"] == 0.5 and m["buffer/groups_without_versions"] == 1
        assert m["buffer/token_version_coverage"] == pytest.approx(2 / 7)
        assert m["buffer/dropped/stale"] == 1
    run(main())


def test_negative_max_staleness_is_a_config_error():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_staleness"):
        BufferOptions(max_staleness=-1)
    with pytest.raises(ValueError, match="max_staleness"):
        AdmissionControl(-1, 4)


def test_admission_arithmetic():
    ac = AdmissionControl(max_staleness=1, groups_per_step=2, base_version=10)
    # at version 10 (no step done) groups 0..3 are consumed by steps 0 and 1: staleness <= 1
    assert [ac.allows(c, 10) for c in range(6)] == [True, True, True, True, False, False]
    assert ac.projected_staleness(4, 10) == 2 and ac.holds == 1
    # one push later two more slots open
    assert ac.allows(4, 11) and ac.allows(5, 11) and not ac.allows(6, 11)
    ac0 = AdmissionControl(max_staleness=0, groups_per_step=3)
    assert [ac0.allows(c, 0) for c in range(4)] == [True, True, True, False]


def test_length_buckets():
    lb = LengthBuckets((4, 16))
    assert lb.labels == ["0-4", "4-16", "16+"]
    lb.record([traj(tokens=1), traj(tokens=5), traj(tokens=20)], accepted=True)
    lb.record([traj(tokens=30), traj(tokens=40), traj(tokens=3)], accepted=False)
    m = lb.metrics("b")
    assert m["b/acceptance/len_0-4"] == 0.5 and m["b/acceptance/len_4-16"] == 1.0
    assert m["b/acceptance/len_16+"] == pytest.approx(1 / 3) and m["b/trajectories/len_16+"] == 3
    with pytest.raises(ValueError, match="increasing"):
        LengthBuckets((8, 4))

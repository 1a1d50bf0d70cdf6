"""What a run records per trajectory (trajectories.mtr): which bodies each ``metrics.trajectories``
form keeps, the record's schema, dropped groups, the episode's conversation and commands."""

from __future__ import annotations

import asyncio
import math
import pickle
from pathlib import Path

import pytest
from pydantic import ValidationError

from miles_engine.checkpoint import RolloutState
from miles_engine.config.recipe import load_recipe
from miles_engine.hub import default_hub
from miles_engine.metrics import MetricsConfig
from miles_engine.metrics.trajectory_recorder import TrajectoryRecorder
from miles_engine.metrics.trajectory_records import kept_bodies, summary
from miles_engine.metrics.trajectory_store import TrajectoryStore
from miles_engine.rollout.buffer import AsyncBuffer, BufferOptions
from miles_engine.rollout.types import Group, Trajectory
from miles_engine.run.record_advantages import driver_advantages
from miles_engine.trainer.config import TrainerConfig

SUMMARY_KEYS = {"step", "weight_version", "task_id", "kind", "group_id", "index", "reward", "advantage", "status",
                "error", "filtered", "tokens", "prompt_tokens", "sampled_tokens", "turns", "tool_calls", "truncated",
                "versions", "gap_mean", "gap_max", "has_body"}
BODY_KEYS = {"token_ids", "pieces", "loss_mask", "rollout_logprobs", "trainer_logprobs", "weight_versions",
             "routed_experts", "reward_components", "messages", "commands"}


def traj(gid: str, index: int, reward: float | None, *, status: str = "ok") -> Trajectory:
    return Trajectory(token_ids=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1], rollout_logprobs=[0.0, 0.0, -0.5, -1.5],
                      weight_versions=[None, None, 3, 4], reward=reward, status=status, task_id=gid.split("@")[0],
                      group_id=gid, index=index, tags={"kind": "echo"}, metrics={"turns": 2.0, "tool_calls": 1.0},
                      transcript={"messages": [{"role": "user", "content": "hi"}],
                                  "commands": [{"command": "ls", "exit_code": 0, "duration_s": 0.01, "started_s": 0.2,
                                                "truncated": False, "output": "x" * 9000, "phase": "agent"}]})


def groups(rewards: list[list[float]]) -> list[Group]:
    return [Group(f"t{g}@{g}", f"t{g}", [traj(f"t{g}@{g}", i, r) for i, r in enumerate(rs)], submitted_version=3)
            for g, rs in enumerate(rewards)]


def recorded(tmp_path: Path, keep: str, gs: list[Group], step: int = 1, seed: int = 0) -> TrajectoryStore:
    rec = TrajectoryRecorder(tmp_path, keep, seed=seed, decode=lambda ids: f"<{ids[0]}>")
    chosen = rec.bodies(step, gs)
    rows = {("t0@0", 0): {"advantage": 0.7, "trainer_logprobs": [9.0, 9.0, -0.25, float("nan")]}}
    rec.write_step(step, 4, gs, chosen, rows, driver_advantages(gs, TrainerConfig().algorithm))
    rec.close()
    store = TrajectoryStore(tmp_path)
    store.refresh()
    return store


def test_best_worst_is_the_default_and_keeps_every_summary_and_two_bodies(tmp_path: Path) -> None:
    assert MetricsConfig().trajectories == "best_worst"
    gs = groups([[0.5, 1.0, 0.0], [0.25, 0.75]])
    store = recorded(tmp_path, "best_worst", gs)
    assert len(store.summaries) == 5 and all(SUMMARY_KEYS <= set(s) for s in store.summaries)
    assert {(s["group_id"], s["index"]) for s in store.summaries if s["has_body"]} == {("t0@0", 1), ("t0@0", 2)}
    full = store.get(next(s["rid"] for s in store.summaries if s["has_body"]))
    assert BODY_KEYS <= set(full) and full["pieces"] == ["<5>", "<6>", "<7>", "<8>"]
    assert all(store.get(s["rid"]).keys() == s.keys() for s in store.summaries if not s["has_body"])  # body {}


def test_the_record_holds_the_trainers_values_and_finite_floats(tmp_path: Path) -> None:
    store = recorded(tmp_path, "all", groups([[0.5, 1.0, 0.0]]))
    first = store.get(store.summaries[0]["rid"])
    assert first["advantage"] == 0.7  # the trainer's, over the driver's
    assert first["trainer_logprobs"] == [0.0, 0.0, -0.25, None]  # zero off the mask, NaN -> null
    assert first["gap_mean"] == first["gap_max"] == 0.25  # the NaN token left out
    assert first["versions"] == [3, 4] and first["prompt_tokens"] == 2 and first["sampled_tokens"] == 2
    assert first["kind"] == "echo" and first["turns"] == 2 and first["tool_calls"] == 1
    assert first["messages"] == [{"role": "user", "content": "hi"}]
    cmd = first["commands"][0]
    assert cmd["exit_code"] == 0 and cmd["started_s"] == 0.2 and len(cmd["output"]) < 4100
    second = store.get(store.summaries[1]["rid"])  # no trainer row: the driver's GRPO advantage
    assert second["trainer_logprobs"] is None and second["gap_mean"] is None
    assert math.isclose(second["advantage"], 0.5 / 0.5, rel_tol=1e-5)  # (1.0 - 0.5) / std(0.5, 1, 0)


def test_sample_n_keeps_n_per_step_reproducibly(tmp_path: Path) -> None:
    gs = groups([[0.0, 1.0, 0.5, 0.5], [1.0, 1.0, 0.0, 0.0]])
    flat = [t for g in gs for t in g.trajectories]
    picks = [kept_bodies(flat, "sample:3", seed=7, step=s) for s in range(1, 6)]
    assert all(len(p) == 3 for p in picks) and len({frozenset(p) for p in picks}) > 1  # varies by step
    assert picks == [kept_bodies(flat, "sample:3", seed=7, step=s) for s in range(1, 6)]  # same seed, same picks
    assert kept_bodies(flat, "sample:50", seed=7, step=1) == {(t.group_id, t.index) for t in flat}
    store = recorded(tmp_path, "sample:3", gs, step=2, seed=7)
    assert {(s["group_id"], s["index"]) for s in store.summaries if s["has_body"]} == picks[1]


@pytest.mark.parametrize("bad", ["sample:0", "sample:x", "best", "ALL", ""])
def test_a_bad_form_is_one_clear_error(bad: str) -> None:
    with pytest.raises(ValidationError) as err:
        MetricsConfig(trajectories=bad)
    assert err.value.error_count() == 1 and err.value.errors()[0]["loc"] == ("trajectories",)
    assert "must be 'best_worst', 'all' or 'sample:N' (N >= 1)" in str(err.value)
    with pytest.raises(Exception, match=r"'metrics\.trajectories' \(got '(sample:0|sample:x|best|ALL|nope)'\).*"
                                        r"must be 'best_worst', 'all' or 'sample:N'"):
        load_recipe("tiny-terminal", [f"metrics.trajectories={bad or 'nope'}"], hub=default_hub())


def test_dropped_groups_are_recorded_with_the_reason_at_the_step_in_progress(tmp_path: Path) -> None:
    rec = TrajectoryRecorder(tmp_path, "all", seed=0, decode=lambda ids: "")
    buffer = AsyncBuffer(BufferOptions(min_group_size=2))
    buffer.on_drop = rec.dropped
    failed = Group("f@0", "f", [traj("f@0", i, None, status="failed") for i in range(2)], submitted_version=1)
    partly = Group("p@1", "p", [traj("p@1", 0, 1.0), traj("p@1", 1, 0.0), traj("p@1", 2, None, status="timeout")],
                   submitted_version=1)
    partly.trajectories[2].token_ids = partly.trajectories[2].loss_mask = []  # nothing sampled: removed
    partly.trajectories[2].rollout_logprobs = partly.trajectories[2].weight_versions = []

    async def put() -> None:
        assert not await buffer.put(failed)
        assert await buffer.put(partly)

    asyncio.run(put())
    rec.write_step(3, 2, [partly], set(), {}, {})
    rec.close()
    store = TrajectoryStore(tmp_path)
    store.refresh()
    got = {(s["group_id"], s["index"]): (s["step"], s["filtered"], s["status"]) for s in store.summaries}
    assert got == {("p@1", 0): (3, None, "ok"), ("p@1", 1): (3, None, "ok"),
                   ("p@1", 2): (3, "removed_failed", "timeout"),
                   ("f@0", 0): (3, "all_failed", "failed"), ("f@0", 1): (3, "all_failed", "failed")}


def test_the_transcript_survives_a_checkpoint_and_older_trajectories_lack_it(tmp_path: Path) -> None:
    g = groups([[1.0, 0.0]])[0]
    back = pickle.loads(pickle.dumps(RolloutState(cursor=3, buffered=[g])))
    assert back.buffered[0].trajectories[0].transcript == g.trajectories[0].transcript
    old = traj("o@0", 0, 1.0)
    del old.__dict__["transcript"]  # as unpickled from a checkpoint written before the field
    rec = TrajectoryRecorder(tmp_path, "all", seed=0, decode=lambda ids: "")
    rec.write_step(1, 1, [Group("o@0", "o", [old], 1)], {("o@0", 0)}, {}, {})
    rec.close()
    store = TrajectoryStore(tmp_path)
    store.refresh()
    assert store.get(store.summaries[0]["rid"])["messages"] == []


def test_summary_maps_non_finite_rewards_to_null() -> None:
    t = traj("n@0", 0, float("nan"))
    s = summary(t, step=1, version=1, advantage=float("inf"), filtered="no_reward", trainer_logprobs=None,
                has_body=False)
    assert s["reward"] is None and s["advantage"] is None and s["filtered"] == "no_reward"


def test_trainer_ranks_elsewhere_are_sent_no_transcripts() -> None:
    from miles_engine.rollout.types import without_transcripts

    gs = groups([[1.0, 0.0]])
    sent = without_transcripts(gs)
    assert all(t.transcript is None for g in sent for t in g.trajectories)
    assert all(t.transcript for g in gs for t in g.trajectories)  # the driver's copies keep theirs
    assert [t.token_ids for t in sent[0].trajectories] == [t.token_ids for t in gs[0].trajectories]


def test_resume_cuts_the_records_of_steps_that_run_again(tmp_path: Path) -> None:
    rec = TrajectoryRecorder(tmp_path, "all", seed=0, decode=lambda ids: "")
    for step in (1, 2, 3):
        rec.write_step(step, step, groups([[1.0, 0.0]]), set(), {}, {})
    rec.close()
    again = TrajectoryRecorder(tmp_path, "all", seed=0, decode=lambda ids: "")  # --resume from step 1
    assert again.resume_at(1) == 4 and again.resume_at(1) == 0
    again.write_step(2, 2, groups([[0.5, 0.0]]), set(), {}, {})
    again.close()
    store = TrajectoryStore(tmp_path)
    store.refresh()
    assert [(s["step"], s["reward"]) for s in store.summaries] == [(1, 1.0), (1, 0.0), (2, 0.5), (2, 0.0)]
    assert store.torn_bytes == 0 and store.corrupt == 0

"""samples.jsonl: which trajectories are kept per step and how they are written."""

from __future__ import annotations

import json

from miles_engine.metrics.samples import MAX_CHARS, SampleLog, clip_text, pick, sample_row
from miles_engine.rollout.types import Group, Trajectory


def traj(reward: float | None, index: int, *, prompt: int = 3, sampled: int = 2) -> Trajectory:
    n = prompt + sampled
    return Trajectory(token_ids=list(range(100, 100 + n)), loss_mask=[0] * prompt + [1] * sampled,
                      rollout_logprobs=[0.0] * n, weight_versions=[None] * prompt + [4] * sampled,
                      reward=reward, task_id="echo-1", group_id="echo-1@0", index=index)


def test_pick_alternates_best_and_worst_and_puts_unscored_last():
    ts = [traj(0.5, 0), traj(None, 1), traj(1.0, 2), traj(0.0, 3), traj(0.25, 4)]
    assert [t.index for t in pick(ts, 2)] == [2, 3]
    assert [t.index for t in pick(ts, 4)] == [2, 3, 0, 4]
    assert [t.index for t in pick(ts, 10)] == [2, 3, 0, 4, 1]
    assert pick(ts, 0) == [] and pick([], 3) == []
    assert [t.index for t in pick([traj(1.0, 0)], 2)] == [0]  # one trajectory is not taken twice


def test_row_decodes_from_the_first_sampled_token():
    seen = []

    def decode(ids: list[int]) -> str:
        seen.append(ids)
        return "x" * 10

    row = sample_row(7, 6, traj(1.0, 2, prompt=3, sampled=2), decode)
    assert seen == [[103, 104]]
    assert row == {"step": 7, "weight_version": 6, "task_id": "echo-1", "group_id": "echo-1@0", "index": 2,
                   "reward": 1.0, "status": "ok", "prompt_tokens": 3, "sampled_tokens": 2, "completion": "x" * 10}


def test_long_completions_keep_head_and_tail():
    text = "a" * MAX_CHARS + "b" * MAX_CHARS
    clipped = clip_text(text)
    assert clipped.startswith("a" * (MAX_CHARS // 2)) and clipped.endswith("b" * (MAX_CHARS // 2))
    assert f"[... {MAX_CHARS} chars ...]" in clipped
    assert clip_text("short") == "short"


def test_log_appends_per_step_and_zero_writes_nothing(tmp_path):
    groups = [Group("g0", "echo-1", [traj(0.0, 0), traj(1.0, 1)], submitted_version=0),
              Group("g1", "echo-1", [traj(0.5, 0)], submitted_version=0)]
    log = SampleLog(tmp_path, 2, lambda ids: " ".join(map(str, ids)))
    log.write(1, 1, groups)
    log.write(2, 2, groups)
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward"]) for r in rows] == [(1, 1.0), (1, 0.0), (2, 1.0), (2, 0.0)]
    assert rows[0]["completion"] == "103 104"
    off = SampleLog(tmp_path / "off", 0, str)
    off.write(1, 1, groups)
    off.close()
    assert not (tmp_path / "off" / "samples.jsonl").exists()

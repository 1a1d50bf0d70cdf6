"""Checkpoint files: atomic under a crash, last K kept, damage and missing optimizer state refused,
recipe / layout differences named, data cursor and requeued groups, consumed.jsonl rollback."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest
import torch

from miles_engine.environments.protocol import TaskRef
from miles_engine.errors import ConfigError
from miles_engine.rollout.buffer import AsyncBuffer, BufferOptions
from miles_engine.rollout.scheduler import Scheduler, SchedulerOptions
from miles_engine.rollout.tasks import TaskStream
from miles_engine.rollout.types import Group
from miles_engine import checkpoint
from miles_engine.checkpoint import compat as checkpoint_compat
from miles_engine.checkpoint import consumed
from miles_engine.checkpoint import crash_points
from tests.rollout.helpers import traj

CONFIG = {"seed": 0, "model": {"hidden_size": 128}, "trainer": {"optimizer": {"lr": 0.001}, "num_threads": 1,
                                                                "parallel": {"world_size": 1, "device": "cpu"}},
          "placement": {"trainer": "subprocess"}, "run": {"steps": 10}}


def trainer_state(rl_steps: int = 1, moments: bool = True) -> dict:
    p = torch.zeros(3)
    state = {0: {"step": torch.tensor(1.0), "exp_avg": p, "exp_avg_sq": p}} if moments else {}
    return {"format": 1, "model": {"w": torch.arange(3.0)}, "optimizer": {"state": state, "param_groups": []},
            "scheduler": {"last_epoch": rl_steps}, "weight_version": 7, "rl_steps": rl_steps, "sft_steps": 0}


def group(gid: str) -> Group:
    return Group(gid, gid.split("@")[0], [traj([1, 2, 3]), traj([4])], submitted_version=7)


def save(run: Path, step: int, keep: int = 2, **state_kw) -> Path:
    rollout = checkpoint.RolloutState(cursor=10 + step, buffered=[group(f"t1@{step}")], requeued=[(9, "t9")])
    manifest = {"weight_version": 7, "fingerprint": checkpoint_compat.fingerprint(CONFIG, "tok"),
                "tokenizer_sha256": "tok", "layout": checkpoint_compat.layout(CONFIG), "config": CONFIG}
    return checkpoint.save(run, step=step, trainer_state=trainer_state(**state_kw), rollout=rollout,
                           rng=checkpoint.rng_states(), manifest=manifest, keep=keep)


def test_roundtrip_and_last_k_kept(tmp_path: Path) -> None:
    for step in range(4):
        save(tmp_path, step, keep=3)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002",
                                                                       "step_00000003"]
    random.seed(5)
    save(tmp_path, 4, keep=3)
    expected = random.random()
    loaded = checkpoint.load_latest(tmp_path)
    assert loaded.step == 4 and loaded.manifest["weight_version"] == 7
    assert torch.equal(loaded.trainer_state["model"]["w"], torch.arange(3.0))
    assert loaded.rollout.cursor == 14 and [g.group_id for g in loaded.rollout.buffered] == ["t1@4"]
    assert loaded.rollout.buffered[0].trajectories[0].sampled_versions == [1, 2, 3]
    assert loaded.rollout.requeued == [(9, "t9")]
    checkpoint.set_rng_states(loaded.rng)
    assert random.random() == expected


def test_a_crash_inside_the_write_leaves_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    code = ("import sys; from pathlib import Path; sys.path.insert(0, '.'); "
            "from tests.checkpoint.test_checkpoint_files import save; save(Path(sys.argv[1]), 1); "
            "save(Path(sys.argv[1]), 2)")
    env = {**os.environ, crash_points.ENV: "checkpoint_write@2"}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, cwd=Path(__file__).parents[2],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    root = checkpoint.checkpoint_dir(tmp_path)
    partial = [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert len(partial) == 1 and partial[0].startswith(".tmp-step_00000002-")
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000001"]
    assert checkpoint.load_latest(tmp_path).step == 1  # the partial one is never read ...
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]  # ... and is cleaned up


def test_damaged_or_incomplete_checkpoints_are_named(tmp_path: Path) -> None:
    path = save(tmp_path, 3)
    with open(path / "trainer.pt", "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(ConfigError, match=r"trainer.pt is 100 bytes, the manifest says \d+"):
        checkpoint.load_latest(tmp_path)
    (path / "manifest.json").unlink()
    with pytest.raises(ConfigError, match="no manifest.json"):
        checkpoint.load_latest(tmp_path)
    with pytest.raises(ConfigError, match="no checkpoint under"):
        checkpoint.load_latest(tmp_path / "elsewhere")


def test_missing_optimizer_state_is_refused(tmp_path: Path) -> None:
    save(tmp_path, 1, rl_steps=3, moments=False)
    with pytest.raises(ConfigError, match="records 3 steps of 'optimizer' but its state is empty"):
        checkpoint.load_latest(tmp_path)
    state = trainer_state()
    del state["optimizer"]
    with pytest.raises(ConfigError, match="no 'optimizer' state"):
        checkpoint.check_trainer_state(state, tmp_path)
    checkpoint.check_trainer_state(trainer_state(rl_steps=0, moments=False), tmp_path)  # step 0: nothing to lose


def test_resume_compatibility_names_each_difference(tmp_path: Path) -> None:
    manifest = {"fingerprint": checkpoint_compat.fingerprint(CONFIG, "tok"), "tokenizer_sha256": "tok",
                "layout": checkpoint_compat.layout(CONFIG), "config": CONFIG}
    mutable = {**CONFIG, "run": {"steps": 99}, "trainer": {**CONFIG["trainer"], "num_threads": 2}}
    checkpoint_compat.check(manifest, mutable, "tok", tmp_path)
    other_backend = {**CONFIG, "trainer": {**CONFIG["trainer"], "backend": "megatron",  # same trainer state format
                                           "megatron": {"tensor_parallel": 1}}}
    checkpoint_compat.check(manifest, other_backend, "tok", tmp_path)
    older = {**manifest, "fingerprint": "written-when-more-keys-were-fingerprinted"}
    checkpoint_compat.check(older, other_backend, "tok", tmp_path)  # the stored recipe decides
    layout = {**CONFIG, "placement": {"trainer": "in_process"}}
    with pytest.raises(ConfigError, match="different parallel layout\n  placement.trainer: checkpoint "
                                          "'subprocess', now 'in_process'"):
        checkpoint_compat.check(manifest, layout, "tok", tmp_path)
    fsdp = {**CONFIG, "trainer": {**CONFIG["trainer"], "parallel": {"world_size": 2, "device": "cpu"}}}
    with pytest.raises(ConfigError, match="trainer.parallel.world_size: checkpoint 1, now 2"):
        checkpoint_compat.check(manifest, fsdp, "tok", tmp_path)
    # megatron -> megatron: the ranks reshard (either checkpoint format), so the world size may change
    mg = {**CONFIG, "trainer": {**CONFIG["trainer"], "backend": "megatron", "parallel": {"world_size": 2,
                                                                                          "device": "cpu"}}}
    mg_manifest = {**manifest, "layout": checkpoint_compat.layout(mg), "config": mg}
    tp1 = {**mg, "trainer": {**mg["trainer"], "parallel": {"world_size": 1, "device": "cpu"}}}
    checkpoint_compat.check(mg_manifest, tp1, "tok", tmp_path)
    with pytest.raises(ConfigError, match="trainer.parallel.world_size: checkpoint 2, now 1"):
        checkpoint_compat.check(mg_manifest, {**tp1, "trainer": {**tp1["trainer"], "backend": "torch"}}, "tok",
                                tmp_path)
    recipe = {**CONFIG, "model": {"hidden_size": 64}}
    with pytest.raises(ConfigError, match="incompatible with the one it was written with\n  model.hidden_size: "
                                          "checkpoint 128, now 64"):
        checkpoint_compat.check(manifest, recipe, "tok", tmp_path)
    with pytest.raises(ConfigError, match="tokenizer"):
        checkpoint_compat.check(manifest, CONFIG, "other", tmp_path)


def test_consumed_log_rolls_back_to_the_checkpoint(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        consumed.append(tmp_path, step, step, [f"t@{step}"])
    with open(tmp_path / consumed.FILE, "a") as fh:
        fh.write('{"step": 4, "weight_')  # torn by a crash
    assert consumed.truncate_after(tmp_path, 2) == 2
    assert [r["groups"] for r in consumed.read(tmp_path)] == [["t@1"], ["t@2"]]
    assert consumed.truncate_after(tmp_path, 2) == 0


def test_task_stream_seeks_to_any_position() -> None:
    refs = [TaskRef(id=f"t{i}") for i in range(7)]
    stream = TaskStream(refs, seed=3)
    full = [r.id for r in islice(iter(stream), 30)]
    for position in (0, 5, 7, 16):
        assert [r.id for r in islice(stream.iter_from(position), 30 - position)] == full[position:]
        assert stream.at(position).id == full[position]
    assert [r.id for r in TaskStream(refs, seed=3, epochs=2).iter_from(12)] == full[12:14]


def test_a_resumed_scheduler_regenerates_requeued_groups_first_then_continues_the_cursor() -> None:
    async def run_trajectory(task, attempt):
        await asyncio.sleep(0)
        return traj([1])

    async def main() -> list[str]:
        buf = AsyncBuffer(BufferOptions(capacity_groups=8))
        sched = Scheduler((f"task{i}" for i in range(5, 100)), run_trajectory, buf,
                          SchedulerOptions(group_size=2, max_inflight=2), first_position=5,
                          requeue=[(2, "task2"), (4, "task4")])
        assert sched.unfinished() == [(2, "task2"), (4, "task4")]
        await sched.start()
        ids = [g.group_id for _ in range(4) for g in await buf.get(1, 0)]
        await sched.stop()
        return ids, sched.next_position

    ids, cursor = asyncio.run(main())
    assert ids == ["task2@2", "task4@4", "task5@5", "task6@6"]
    assert cursor >= 7


@pytest.mark.parametrize("spec", ["nowhere@1", "train_step", "train_step@x", "train_step@1+-2"])
def test_crash_point_spec_errors_name_the_variable(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(crash_points.ENV, spec)
    with pytest.raises(ConfigError, match=f"{crash_points.ENV}=.*one of generation, train_step, checkpoint_write"):
        crash_points.check_env()

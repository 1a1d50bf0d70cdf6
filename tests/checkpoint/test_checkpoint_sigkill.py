"""SIGKILL a real ``miles train`` run (its whole process group) at chosen and random points, resume
it until it finishes, and compare what it trained on with an uninterrupted run of the same seed.

The recipe is the tiny one, shortened: subprocess trainer (as packaged), ``sync`` mode, so the
groups each step trains on are fixed by the data order and the comparison is exact per step.
This test process is made a child subreaper, so any process of a killed run that outlives its
process group (an orphan) is re-parented to it and found.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from miles_engine.checkpoint import consumed

STEPS = 5
FAST = ["sft.enabled=false", "tokenizer.corpus_demos=500", "rollout.mode=sync", "placement.trainer=subprocess",
        "rollout.group_size=4", "rollout.groups_per_step=2", "rollout.max_inflight=8", "buffer.capacity_groups=4",
        "run.checkpoint_every=1", "metrics.progress=false", f"run.steps={STEPS}"]
MILES = [sys.executable, "-m", "miles_engine.cli.main", "train"]
PR_SET_CHILD_SUBREAPER = 36


# Children this test process already had before a test (e.g. its own multiprocessing resource
# tracker, started by earlier tests in the same session): not orphans of the runs under test.
_OWN_CHILDREN: set[str] = set()


@pytest.fixture
def subreaper() -> Iterator[None]:
    libc = ctypes.CDLL(None, use_errno=True)
    _OWN_CHILDREN.clear()
    _OWN_CHILDREN.update(line.split()[0] for line in orphans())
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    yield
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def orphans() -> list[str]:
    """Processes re-parented to this test process (reaping the dead ones)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or entry.name in _OWN_CHILDREN:
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) != me:
            continue
        if fields[0] == "Z":
            os.waitpid(int(entry.name), os.WNOHANG)
            continue
        cmdline = (entry / "cmdline").read_bytes().replace(bytes(1), b" ")[:120]
        found.append(f"{entry.name} {cmdline!r}")
    return found


def start(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``miles train ARGS`` in its own session (process group), output appended to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(MILES + args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})


def kill_group(proc: subprocess.Popen[bytes], log: Path) -> str:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    assert_no_orphans()
    return log.read_text(errors="replace")


def assert_no_orphans() -> None:
    """Allow a few seconds: multiprocessing's resource tracker exits just after its parent."""
    deadline = time.monotonic() + 10
    while (left := orphans()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes outlived the run: {left}"


def trained(run: Path) -> list[tuple[int, int, list[str]]]:
    return [(r["step"], r["weight_version"], sorted(r["groups"])) for r in consumed.read(run)]


def wait_for(predicate: Callable[[], bool], proc: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def finish(run: Path, log: Path) -> str:
    proc = start(["--resume", str(run)], log)
    proc.wait(timeout=240)
    out = log.read_text(errors="replace")
    assert proc.returncode == 0, out[-3000:]
    assert_no_orphans()
    return out


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, int, list[str]]]:
    out_dir = tmp_path_factory.mktemp("baseline")
    proc = start(["tiny-terminal", *FAST, f"run.out_dir={out_dir}", "run.name=b"], out_dir / "log")
    proc.wait(timeout=240)
    assert proc.returncode == 0, (out_dir / "log").read_text()[-3000:]
    rows = trained(out_dir / "b")
    assert [r[0] for r in rows] == list(range(1, STEPS + 1)) and [r[1] for r in rows] == list(range(1, STEPS + 1))
    return rows


def assert_same_training(run: Path, baseline: list[tuple[int, int, list[str]]]) -> None:
    rows = trained(run)
    ids = [g for _, _, groups in rows for g in groups]
    assert len(ids) == len(set(ids)), f"a group was trained twice: {rows}"
    assert rows == baseline, f"resumed run trained differently:\n{rows}\nvs uninterrupted:\n{baseline}"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
    train_rows = [m for m in metrics if m["kind"] == "train"]
    # sync mode: every group was sampled by the weights the trainer held (engines at the restored weights)
    assert all(m.get("buffer/taken/s_old_max", 0) == 0 for m in train_rows), train_rows
    assert not list((run / "checkpoints").glob(".tmp-*"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_crash_points_chain_then_resume_trains_every_group_once(tmp_path: Path, baseline, subreaper) -> None:
    """One run crashed in generation, in a train step, inside a checkpoint write, in a weight
    publish and with its trainer's state offloaded to disk, resumed after each; it finishes and
    trained exactly what the uninterrupted run (no offload) did."""
    run = tmp_path / "r"
    crashes = ["generation@1+0.3", "train_step@2+0.02", "checkpoint_write@3", "weight_publish@4+0.01",
               "trainer_offloaded@4"]
    args = ["tiny-terminal", *FAST, "trainer.offload=disk", f"run.out_dir={tmp_path}", "run.name=r"]
    log = tmp_path / "log"
    for crash in crashes:
        proc = start(args, log, {"MILES_TEST_CRASH_AT": crash})
        proc.wait(timeout=240)
        out = kill_group(proc, log)  # the rest of the group (trainer rank, sandboxes) goes down too
        assert proc.returncode == -signal.SIGKILL, f"{crash}: exit {proc.returncode}\n{out[-3000:]}"
        if crash.startswith("checkpoint_write"):
            assert list((run / "checkpoints").glob(".tmp-step_00000003-*")), "the crash left no partial write"
            assert not (run / "checkpoints" / "step_00000003").exists()
        args = ["--resume", str(run)]
    out = finish(run, log)
    assert "resumed from" in out
    assert_same_training(run, baseline)
    assert not list((run / "offload").iterdir()), "an offload file outlived its run"
    offloaded = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
    assert all(m["train/offload_bytes_optimizer"] > 0 for m in offloaded if m["kind"] == "train")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sigkill_at_random_points(tmp_path: Path, baseline, subreaper, seed: int) -> None:
    """Killed anywhere, resumed, it trained what the uninterrupted run did; seed 2 keeps its
    optimizer state on disk (trainer.optimizer_state=disk: bit-identical, the same checkpoints)."""
    rng = random.Random(seed)
    run = tmp_path / "r"
    streamed = ["trainer.optimizer_state=disk"] if seed == 2 else []
    args = ["tiny-terminal", *FAST, *streamed, f"run.out_dir={tmp_path}", "run.name=r"]
    log = tmp_path / "log"
    proc = start(args, log)
    ckpts = run / "checkpoints"
    wait_for(lambda: ckpts.is_dir() and any(ckpts.glob("step_*")), proc, 180)
    time.sleep(rng.uniform(0.0, 5.0))  # somewhere in steps 1..STEPS: generating, training, writing, pushing
    kill_group(proc, log)
    assert any(ckpts.glob("step_*")), log.read_text()[-3000:]
    finish(run, log)
    assert_same_training(run, baseline)
    if streamed:
        assert (run / "optimizer_state").is_dir() and not list((run / "optimizer_state").iterdir()), \
            "a state file outlived its run"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fully_async_resume_trains_buffered_and_requeued_groups_exactly_once(tmp_path: Path, subreaper) -> None:
    """fully_async: which step takes which group depends on timing, so the check is exactly-once:
    no group trained twice, and every group the checkpoint carried (finished in the buffer, or
    running and requeued) is trained after the resume."""
    run, log = tmp_path / "r", tmp_path / "log"
    args = [a for a in FAST if not a.startswith(("rollout.mode", "run.steps", "rollout.max_inflight"))]
    args += ["rollout.mode=fully_async", "rollout.max_inflight=16", "run.steps=8"]
    proc = start(["tiny-terminal", *args, f"run.out_dir={tmp_path}", "run.name=r"], log)
    assert wait_for(lambda: (run / "checkpoints" / "step_00000002").exists(), proc, 240), log.read_text()[-3000:]
    time.sleep(0.5)
    kill_group(proc, log)
    newest = sorted((run / "checkpoints").glob("step_*"))[-1]
    carried = json.loads((newest / "manifest.json").read_text())["rollout"]
    finish(run, log)
    rows = trained(run)
    ids = [g for _, _, groups in rows for g in groups]
    assert len(ids) == len(set(ids)), f"a group was trained twice: {rows}"
    assert [r[0] for r in rows] == list(range(1, 9)) and [r[1] for r in rows] == list(range(1, 9))
    assert set(carried["buffered"]) | set(carried["requeued"]) <= set(ids), (carried, rows)

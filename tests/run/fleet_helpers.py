"""Shared by the fleet and Ray end-to-end tests: a warm tiny-terminal run directory resumed
with another fleet / placement for 30 RL steps, and the checks that it learned and that every
group is accounted for."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from tests.run.learning import assert_held_out_rise

MILES = [sys.executable, "-m", "miles_engine.cli.main", "train"]
FLEET = ["engines=[{kind: server, replicas: 2}]", "run.max_minutes=null", "metrics.progress=false",
         "fleet.health_interval_s=0.5"]


# a safety stop, not a speed bar: the shared warm start (938 SFT steps) takes ~5 min on a quiet 2-core
# box and measured over 9 min while other work ran on it
def train_cli(args: list[str], timeout: float = 1500) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*MILES, *args], capture_output=True, text=True, timeout=timeout, env=env)


def metric_rows(run: Path, kind: str = "train") -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def make_warm_run(out: Path) -> Path:
    """The recipe's SFT warm start, then one RL step on its embedded engine: a resumable run dir."""
    # eval.split.by=hash: its training tasks leave the held-out ones out, so a resumed copy may evaluate
    # on them (a resume that changes the split is refused)
    proc = train_cli(["tiny-terminal", "run.steps=1", "run.max_minutes=null", "metrics.progress=false",
                   "eval.split.by=hash", f"run.out_dir={out}", "run.name=warm"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out / "warm"


RECIPE_STEPS = 31  # the warm run's step 1, then 30 RL steps


def make_recipe_run(warm: Path, run: Path) -> Path:
    """The recipe as shipped resumed from ``warm`` for 30 more RL steps on its own engines, evaluated
    on the 32 held-out drills x 4 attempts at the resumed step and every 10 steps (shared mode: the
    training waits), checkpointed every 10 (all kept). The suite's one learning run of the recipe:
    tests/run/test_tiny_terminal_e2e.py and tests/evaluation/test_train_eval.py read it, never write."""
    shutil.copytree(warm, run)
    proc = train_cli(["--resume", str(run), f"run.steps={RECIPE_STEPS}", "run.max_minutes=null",
                      "run.checkpoint_every=10", "run.checkpoint_keep=5", "metrics.progress=false",
                      "eval.every=10", "eval.limit=32", "eval.attempts=4"], timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


def resume_with(warm: Path, dest: Path, overrides: list[str], *, while_running=None) -> Path:
    shutil.copytree(warm, dest)
    if while_running is None:
        proc = train_cli(["--resume", str(dest), *FLEET, "run.steps=31", *overrides])
    else:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        child = subprocess.Popen([*MILES, "--resume", str(dest), *FLEET, "run.steps=31", *overrides],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        watcher = threading.Thread(target=while_running, args=(dest,), daemon=True)
        watcher.start()
        out, _ = child.communicate(timeout=1500)
        watcher.join(timeout=60)
        proc = subprocess.CompletedProcess(child.args, child.returncode, out, "")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return dest


def assert_learns(run: Path, *, one_outage: bool = False) -> list[dict]:
    """Learned (tests/run/learning.py: held-out evaluations at the first and last steps, which
    the run must have been given, e.g. with EVAL_FIRST_AND_LAST); the router used both engines.
    ``one_outage``: one engine may be down for one stretch of steps (killed, then restarted: a
    restart takes wall-clock seconds, however many steps that is on this box) and must be back
    before the last step; otherwise both engines are up at every step."""
    train = [r for r in metric_rows(run) if r["step"] > 1]  # the RL steps on the fleet
    assert len(train) == 30
    assert_held_out_rise(run, train, " on the fleet")
    down = [r["step"] for r in train if r["engines/healthy"] != 2 or r["weights/engines"] != 2]
    if one_outage and down:
        assert down == list(range(down[0], down[-1] + 1)), f"more than one outage: steps {down}"
        assert down[-1] < train[-1]["step"], f"the engine never came back: down from step {down[0]} to the end"
    else:
        assert not down, f"steps with an engine down: {down}"
    # the router spread the episodes over both engine processes
    assert sum(r["engines/server-0/requests"] for r in train) > 0 < sum(r["engines/server-1/requests"] for r in train)
    assert max(r["weights/version"] for r in train) > train[0]["weights/version"]
    return train


def assert_accounted(run: Path, train: list[dict]) -> None:
    """Every submitted group is trained exactly once, filtered/dropped (counted), or still running."""
    last = train[-1]
    consumed = [json.loads(line) for line in (run / "consumed.jsonl").read_text().splitlines()]
    ids = [g for row in consumed for g in row["groups"]]
    assert len(ids) == len(set(ids)), "a group was trained twice"
    s = {k.removeprefix("scheduler/"): v for k, v in last.items() if k.startswith("scheduler/")}
    b = {k.removeprefix("buffer/"): v for k, v in last.items() if k.startswith("buffer/")}
    ended = s.get("groups_put", 0) + s.get("groups_filtered", 0) + s.get("groups_cancelled", 0) \
        + s.get("groups_discarded_closed", 0)
    assert s["submitted_groups"] == ended + b["running_groups"], (s, b)
    assert b["groups_put"] + b["groups_restored"] == b["groups_taken"] + b["groups_evicted"] + b["queue_size"], b




def engine_pid(run: Path, name: str) -> int | None:
    """The pid of engine ``name``'s server process of ``run``, or None when none runs."""
    port_file = run / "engines" / name / "port"
    out = subprocess.run(["pgrep", "-f", "--", f"--port-file {port_file}"], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None


def sigkill_engine_after(step: int, name: str, killed: list[int]):
    """A ``while_running`` watcher for :func:`resume_with`: once the run has logged training step
    ``step``, SIGKILL engine ``name``'s server process (its pid appended to ``killed``); bounded."""
    import signal
    import time

    def watch(run: Path) -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed:
            metrics = run / "metrics.jsonl"
            rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
            pid = engine_pid(run, name)
            if pid is not None and any(r["kind"] == "train" and r["step"] >= step for r in rows):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.2)

    return watch


def vllm_pid(run: Path) -> int | None:
    """The pid of the vLLM server a run launched (found by its port file under the run), if any."""
    out = subprocess.run(["pgrep", "-f", "--", f"--port-file {run}/engines/"], capture_output=True, text=True)
    pids = out.stdout.split()
    return int(pids[0]) if pids else None

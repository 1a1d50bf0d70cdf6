"""tiny-terminal on a fleet of `server` engine processes behind the router: it learns over the
broadcast (gloo) and disk_delta transports, and a SIGKILLed engine process is restarted with
the current weights while the run goes on, with every group accounted for.

The SFT warm start runs once (the recipe as shipped, then 1 RL step on the embedded engine);
each variant resumes a copy of that run directory with another fleet and transport (both may
change on resume: engines start from the trainer's weights) for 30 more RL steps. Bounded by
steps; the recipe's wall-clock limit is lifted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

MILES = [sys.executable, "-m", "miles_engine.cli.main", "train"]
FLEET = ["engines=[{kind: server, replicas: 2}]", "run.max_minutes=null", "metrics.progress=false",
         "fleet.health_interval_s=0.5"]


def moving_average(values: list[float], k: int = 3) -> list[float]:
    return [statistics.fmean(values[i:i + k]) for i in range(len(values) - k + 1)]


def _train(args: list[str], timeout: float = 540) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*MILES, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _rows(run: Path, kind: str = "train") -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recipe's SFT warm start, then one RL step on its embedded engine: a resumable run dir."""
    out = tmp_path_factory.mktemp("fleet")
    proc = _train(["tiny-terminal", "run.steps=1", "run.max_minutes=null", "metrics.progress=false",
                   f"run.out_dir={out}", "run.name=warm"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out / "warm"


def _resume(warm: Path, dest: Path, overrides: list[str], *, while_running=None) -> Path:
    shutil.copytree(warm, dest)
    if while_running is None:
        proc = _train(["--resume", str(dest), *FLEET, "run.steps=31", *overrides])
    else:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        child = subprocess.Popen([*MILES, "--resume", str(dest), *FLEET, "run.steps=31", *overrides],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        watcher = threading.Thread(target=while_running, args=(dest,), daemon=True)
        watcher.start()
        out, _ = child.communicate(timeout=540)
        watcher.join(timeout=60)
        proc = subprocess.CompletedProcess(child.args, child.returncode, out, "")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return dest


def _assert_learns(run: Path) -> list[dict]:
    train = [r for r in _rows(run) if r["step"] > 1]  # the RL steps on the fleet
    assert len(train) == 30
    ma = moving_average([r["reward/mean"] for r in train])
    assert max(ma) - ma[0] >= 0.3, f"3-step moving average did not rise by 0.3 on the fleet: {ma}"
    assert all(r["engines/healthy"] == 2 or r["engines/restarts"] > 0 for r in train)
    # the router spread the episodes over both engine processes
    assert sum(r["engines/server-0/requests"] for r in train) > 0 < sum(r["engines/server-1/requests"] for r in train)
    assert all(r["weights/engines"] == 2 for r in train)
    assert max(r["weights/version"] for r in train) > train[0]["weights/version"]
    return train


def _assert_accounted(run: Path, train: list[dict]) -> None:
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


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", ["broadcast", "disk_delta"])
def test_two_server_engines_learn(warm_run: Path, tmp_path: Path, transport: str) -> None:
    run = _resume(warm_run, tmp_path / "run", [f"weights.transport={transport}"])
    train = _assert_learns(run)
    _assert_accounted(run, train)
    assert all(r["engines/restarts"] == 0 for r in train)


def _engine_pid(run: Path, name: str) -> int | None:
    port_file = run / "engines" / name / "port"
    out = subprocess.run(["pgrep", "-f", "--", f"--port-file {port_file}"], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_of_an_engine_process_mid_run(warm_run: Path, tmp_path: Path) -> None:
    killed: list[int] = []

    def kill_after_a_few_steps(run: Path) -> None:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            metrics = run / "metrics.jsonl"
            rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
            pid = _engine_pid(run, "server-0")
            if pid is not None and any(r["kind"] == "train" and r["step"] >= 5 for r in rows):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.2)

    run = _resume(warm_run, tmp_path / "run", ["weights.transport=broadcast", "weights.check_update_equal=true"],
                  while_running=kill_after_a_few_steps)
    assert killed, "the engine process was never found to kill"
    train = [r for r in _rows(run) if r["step"] > 1]
    assert len(train) == 30  # the run finished
    assert train[-1]["engines/server-0/restarts"] >= 1 and train[-1]["engines/restarts"] >= 1
    assert _engine_pid(run, "server-0") is None  # nothing left running after the run
    _assert_accounted(run, train)
    # after the restart the engine got the current weights: every later push was checked tensor by tensor
    after = [r for r in train if r["engines/server-0/restarts"] >= 1]
    assert after and all(r["weights/tensors_checked"] > 0 and r["weights/engines"] == 2 for r in after[1:])
    assert sum(r["engines/server-0/requests"] for r in after) > 0  # it served again

"""tiny-terminal with ``placement.backend=ray`` on a private one-node cluster (2 CPUs, loopback
only): two ``server`` engines and the trainer rank are Ray actors; weights are broadcast (gloo)
and checked tensor by tensor after every push; trainer rank 0's actor broadcasts them. In the
learning run the episodes go through a session-server actor (``placement.ray.session_servers=1``).
Mid-run one engine actor is SIGKILLed: a fresh actor takes its bundle with the current weights
(its new address reaches the session-server actor), and every group is accounted for. While it
runs, every listening socket of the run's processes (driver, Ray's head, the actors, the
engine servers) is on loopback; afterwards none of those processes remains.

Resumes the session's warm run (tests/conftest.py) for 30 RL steps; bounded by steps. Learning
is judged on held-out drills evaluated at the first and last steps (tests/run/learning.py).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.run.fleet_helpers import FLEET, MILES, assert_accounted, assert_learns, metric_rows
from tests.run.learning import EVAL_FIRST_AND_LAST

psutil = pytest.importorskip("psutil")
pytest.importorskip("ray")  # the `ray` extra; ./dev.sh test installs it

# a 2-CPU cluster with the default reservations: they shrink to fit it (placement.fit_cpus)
RAY = ["placement.backend=ray", "placement.ray.num_cpus=2", "weights.transport=broadcast",
       "weights.check_update_equal=true"]
SESSION_ACTOR = ["placement.ray.session_servers=1"]


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


class RunWatcher:
    """Follows the driver's process tree: listening sockets, the engine actor to kill, every pid seen."""

    def __init__(self, driver: subprocess.Popen[str], run: Path) -> None:
        self.driver, self.run = psutil.Process(driver.pid), run
        self.seen: dict[int, float] = {}  # pid -> create_time (pids are reused)
        self.exposed: list[str] = []
        self.killed: list[int] = []

    def tree(self) -> list[Any]:
        try:
            return [self.driver, *self.driver.children(recursive=True)]
        except psutil.Error:
            return []

    def scan(self) -> None:
        for proc in self.tree():
            try:
                self.seen.setdefault(proc.pid, proc.create_time())
                for conn in proc.net_connections(kind="inet"):
                    if conn.status == psutil.CONN_LISTEN and not _loopback(conn.laddr.ip):
                        self.exposed.append(f"{proc.name()} (pid {proc.pid}) listens on {conn.laddr.ip}:{conn.laddr.port}")
            except psutil.Error:
                continue

    def engine_actor(self, name: str) -> Any:
        """The Ray actor process whose engine server logs to engines/NAME/server.log."""
        log = str(self.run / "engines" / name / "server.log")
        for proc in self.tree():
            try:
                if any(f.path == log for f in proc.open_files()) and "run.engine_server" in " ".join(proc.cmdline()):
                    return proc.parent()
            except psutil.Error:
                continue
        return None

    def __call__(self, stop: threading.Event) -> None:
        deadline = time.monotonic() + 500
        while not stop.is_set() and time.monotonic() < deadline:
            self.scan()
            if not self.killed:
                rows = metric_rows(self.run) if (self.run / "metrics.jsonl").exists() else []
                actor = self.engine_actor("server-0")
                if actor is not None and any(r["step"] >= 5 for r in rows):
                    actor.send_signal(signal.SIGKILL)
                    self.killed.append(actor.pid)
            time.sleep(0.5)

    def survivors(self) -> list[str]:
        left = []
        for pid, created in self.seen.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{proc.name()} (pid {pid})")
            except psutil.Error:
                continue
        return left


def finish_watched(driver: subprocess.Popen[str], watch: Any) -> str:
    """The driver's output once it exits, ``watch(stop_event)`` running beside it meanwhile."""
    stop = threading.Event()
    thread = threading.Thread(target=watch, args=(stop,), daemon=True)
    thread.start()
    try:
        out, _ = driver.communicate(timeout=600)
    finally:
        stop.set()
        thread.join(timeout=30)
        if driver.poll() is None:
            driver.kill()
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_placement_learns_and_survives_an_engine_actor_kill(warm_run: Path, tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(warm_run, run)
    temp = Path(tempfile.mkdtemp(prefix="mr-", dir="/tmp"))  # short: Ray's socket paths stay < 108 bytes
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    driver = subprocess.Popen([*MILES, "--resume", str(run), *FLEET, "run.steps=31", *RAY, *SESSION_ACTOR,
                               *EVAL_FIRST_AND_LAST, f"placement.ray.temp_dir={temp}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    watcher = RunWatcher(driver, run)
    out = finish_watched(driver, watcher)
    (run / "driver.log").write_text(out)
    assert driver.returncode == 0, out[-4000:]
    assert watcher.killed, "the engine actor was never found to kill"
    assert not watcher.exposed, watcher.exposed
    assert len(watcher.seen) >= 5  # driver, Ray's head processes, the actors, the engine servers

    train = assert_learns(run, one_outage=True)
    assert_accounted(run, train)
    last = train[-1]
    assert last["engines/server-0/restarts"] >= 1 and last["ray/restarts/server-0"] >= 1
    # 2 engines + 1 trainer rank + 2 episode runners (their sandboxes) + 1 session server, in 4 placement groups
    assert last["ray/actors"] == 6 and last["ray/placement_groups"] == 4 and last["runners/live"] == 2
    assert last["ray/session_servers"] == 1 and last["session_servers/turns"] > 0
    assert "runners/episodes_lost" not in last and not any(k.startswith("ray/restarts/runner") for k in last)
    assert not any(k.startswith("ray/restarts/session-server") for k in last)
    # broadcast from trainer rank 0's actor: no pushed tensor passed through the driver, even after the restart
    pushes = [r for r in train if "weights/sender_rank0" in r]
    assert pushes and all(r["weights/sender_rank0"] == 1 and r["weights/driver_bytes"] == 0 for r in pushes)
    after = [r for r in train if r["engines/server-0/restarts"] >= 1]
    # every push is checked; the replacement rejoins (how many steps its start takes depends on the
    # machine: steps are sub-second here) and from then on every push reaches both engines
    assert after and all(r["weights/tensors_checked"] > 0 for r in after)
    rejoined = next((i for i, r in enumerate(after) if r["weights/engines"] == 2), None)
    assert rejoined is not None, [r["weights/engines"] for r in after]
    assert all(r["weights/engines"] == 2 for r in after[rejoined:]), [r["weights/engines"] for r in after]
    assert sum(r["engines/server-0/requests"] for r in after) > 0  # the replacement actor served

    deadline = time.monotonic() + 30
    while watcher.survivors() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not watcher.survivors(), f"left running after the run: {watcher.survivors()}"
    shutil.rmtree(temp, ignore_errors=True)


def test_a_local_run_never_imports_ray() -> None:
    """Ray is imported by the Ray placement only (core imports stay light)."""
    code = "import miles_engine.run.compose, sys; print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_dead_trainer_rank_actor_stops_the_run_and_resume_trains_every_group_once(warm_run: Path,
                                                                                  tmp_path: Path) -> None:
    """The trainer rank's actor is SIGKILLed mid-run (weights by disk_delta through the run
    directory, checked): the run stops with one error naming the rank, nothing of Ray stays; ``--resume`` (here on the local placement: the backend may change)
    finishes from the last checkpoint and no group is trained twice."""
    import json
    import shutil

    run = tmp_path / "run"
    shutil.copytree(warm_run, run)
    temp = Path(tempfile.mkdtemp(prefix="mr-", dir="/tmp"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    driver = subprocess.Popen([*MILES, "--resume", str(run), *FLEET, "run.steps=8", "run.checkpoint_every=2", *RAY,
                               "weights.transport=disk_delta", f"placement.ray.temp_dir={temp}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    watcher = RunWatcher(driver, run)
    killed: list[int] = []

    def kill_the_rank(stop: threading.Event) -> None:
        deadline = time.monotonic() + 500
        while not stop.is_set() and time.monotonic() < deadline:
            watcher.scan()
            rows = metric_rows(run) if (run / "metrics.jsonl").exists() else []
            if any(r["step"] >= 3 for r in rows):
                for proc in watcher.tree():
                    try:
                        if proc.name().startswith("ray::RankHost"):
                            proc.send_signal(signal.SIGKILL)
                            killed.append(proc.pid)
                            return
                    except psutil.Error:
                        continue
            time.sleep(0.3)

    out = finish_watched(driver, kill_the_rank)
    assert killed, "the trainer rank actor was never found to kill"
    assert driver.returncode != 0, out[-3000:]
    assert "trainer rank 0 (Ray actor) died" in out, out[-3000:]
    # disk_delta under Ray: the engine actors load each version from RUN_DIR/weights, checked tensor by tensor
    pushed = [r for r in metric_rows(run) if r.get("weights/engines") == 2]
    assert pushed and all(r["weights/tensors_checked"] > 0 for r in pushed)
    assert any((run / "weights").iterdir())
    deadline = time.monotonic() + 30
    while watcher.survivors() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not watcher.survivors(), f"left running after the failed run: {watcher.survivors()}"
    shutil.rmtree(temp, ignore_errors=True)

    proc = subprocess.run([*MILES, "--resume", str(run), *FLEET, "run.steps=8", "weights.transport=broadcast"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    consumed = [json.loads(line) for line in (run / "consumed.jsonl").read_text().splitlines()]
    ids = [g for row in consumed for g in row["groups"]]
    assert len(ids) == len(set(ids)), "a group was trained twice"
    steps = sorted({row["step"] for row in consumed})
    assert steps == list(range(steps[0], 9)), steps  # every step from the warm run's to 8, once

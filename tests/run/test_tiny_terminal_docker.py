"""Training on real-engine tasks: the tiny-terminal recipe, shortened, on a mixture of shell drills
and Harbor tasks that build their own image from a Dockerfile, every episode in a container of the
private Docker engine (``scripts/container_engine.sh``; ``./dev.sh test`` starts it). A Harbor task
that asks for a GPU is in the set: it is excluded at start-up with its reason, the rest train.

Checked: a reward row per step, the ``sandbox/*`` metrics of the docker backend (creations, the
Dockerfile built once and then reused), Harbor episodes among the trained ones, and every
container, volume and network of the run gone afterwards."""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ENGINE = os.environ.get("MILES_DOCKER_BINARY") or "docker"
STEPS = 3
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

DOCKERFILE = """\
FROM ubuntu:24.04
RUN mkdir -p /app && echo ready > /app/.prepared && echo {build_id} > /app/.build
WORKDIR /app
"""
TASK_TOML = """\
schema_version = "1.4"
[metadata]
difficulty = "easy"
[agent]
timeout_sec = 60.0
[verifier]
timeout_sec = 30.0
[environment]
{environment}
"""
# the reward needs the image's own file: a task run without its Dockerfile cannot pass
TEST_SH = """\
#!/bin/bash
if [ -f /app/.prepared ] && [ "$(cat /app/answer.txt 2>/dev/null)" = "{answer}" ]; then r=1; else r=0; fi
echo $r > /logs/verifier/reward.txt
"""


def _harbor_task(root: Path, name: str, answer: str, build_id: str, environment: str = "") -> None:
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution").mkdir()
    (task / "task.toml").write_text(TASK_TOML.format(environment=environment))
    (task / "instruction.md").write_text(f"Write {answer} to /app/answer.txt.\n")
    (task / "environment" / "Dockerfile").write_text(DOCKERFILE.format(build_id=build_id))
    (task / "tests" / "test.sh").write_text(TEST_SH.format(answer=answer))
    (task / "solution" / "solve.sh").write_text(f"#!/bin/bash\necho {answer} > /app/answer.txt\n")


def _engine_problem() -> str | None:
    if shutil.which(ENGINE) is None:
        return f"no {ENGINE} CLI on PATH (scripts/container_engine.sh start)"
    res = subprocess.run([ENGINE, "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True,
                         timeout=30)
    return None if res.returncode == 0 else f"no Docker engine reachable: {res.stderr.strip()[-300:]}"


def _left_over(run_id: str) -> dict[str, list[str]]:
    out = {}
    for kind in ("container", "volume", "network"):
        argv = [ENGINE, kind, "ls", "--quiet", "--filter", f"label=miles.run={run_id}"]
        if kind == "container":
            argv.insert(3, "--all")
        res = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
        out[kind] = res.stdout.split()
    return out


@pytest.fixture(scope="module")
def docker_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, str]]:
    problem = _engine_problem()
    if problem:
        pytest.skip(problem)
    root = tmp_path_factory.mktemp("docker-train")
    tasks = root / "harbor"
    run_id = "dtrain-" + secrets.token_hex(4)
    # the same image for both tasks, new to the engine: built once in the run, then reused
    _harbor_task(tasks, "write-seven", "7", run_id)
    _harbor_task(tasks, "write-ok", "ok", run_id)
    _harbor_task(tasks, "needs-gpu", "1", run_id, environment="gpus = 1")
    recipe = yaml.safe_load((REPO / "recipes" / "tiny-terminal.yaml").read_text())
    recipe["environment"] = {"name": "mixture", "options": {"sources": [
        {"name": "shell-drills", "options": {"kinds": ["echo", "calc"], "num_tasks": 64,
                                             "operand_digits_min": 2, "operand_digits_max": 2}},
        {"name": "harbor", "options": {"path": str(tasks)}, "repeat": 32},
    ]}}
    recipe["sandbox"] = {"backend": "docker", "options": {"run_id": run_id, "max_sandboxes": 8}}
    recipe["rollout"].update(group_size=2, groups_per_step=4, max_inflight=8, episode_timeout_s=240)
    recipe["agent"]["options"]["timeout_s"] = 240
    recipe["tokenizer"]["corpus_demos"] = 300
    recipe["sft"].update(demos=128, epochs=1, batch_size=16)
    recipe["trainer"]["sft"]["lr_schedule"].update(warmup_steps=2, total_steps=8)
    recipe.pop("eval")
    recipe["run"] = {"steps": STEPS, "checkpoint_every": STEPS, "max_minutes": None, "out_dir": str(root),
                     "name": "r"}
    recipe["metrics"] = {"progress": False}
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    log = root / "log"
    with open(log, "wb") as f:
        proc = subprocess.run([sys.executable, "-m", "miles_engine.cli.main", "train", str(root / "recipe.yaml")],
                              stdout=f, stderr=subprocess.STDOUT, cwd=REPO, timeout=1400)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    yield root / "r", run_id, text
    images = subprocess.run([ENGINE, "image", "ls", "--quiet", "--filter", f"label=miles.run={run_id}"],
                            capture_output=True, text=True, timeout=60).stdout.split()
    if images:  # the run's own build: every test run builds a new one
        subprocess.run([ENGINE, "image", "rm", "--force", *set(images)], capture_output=True, timeout=120)


def test_training_on_dockerfile_tasks_in_a_mixture(docker_run: tuple[Path, str, str]) -> None:
    run, _, _ = docker_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1)), [r.get("step") for r in train]
    for r in train:
        assert math.isfinite(r["reward/mean"]) and 0.0 <= r["reward/mean"] <= 1.0, r
        assert r["rollout/num_groups"] >= 4, r
    sandbox = {k: sum(r.get(k, 0.0) for r in train) for r in train for k in r if k.startswith("sandbox/")}
    assert sandbox.get("sandbox/create_n", 0) >= 8, sorted(sandbox)
    # the two Dockerfile tasks have the same content, new to the engine: one build (concurrent first
    # creates wait for it), then cache hits
    assert sandbox.get("sandbox/builds") == 1 and sandbox.get("sandbox/build_cache_hits", 0) >= 1, sandbox
    # reward/<kind>: a Harbor task's kind is its task set's name
    assert any("reward/harbor" in r for r in train), [sorted(k for k in r if k.startswith("reward/")) for r in train]
    assert all(set(r) & {"reward/echo", "reward/calc", "reward/harbor"} for r in train)


def test_gpu_task_excluded_with_its_reason_and_the_rest_trained(docker_run: tuple[Path, str, str]) -> None:
    run, _, log = docker_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    excluded = [r["environment/tasks_excluded"] for r in rows if "environment/tasks_excluded" in r]
    assert excluded and excluded[0] == 32.0, excluded  # the GPU task, listed 32 times by the mixture's repeat
    assert "1/needs-gpu (listed 32 times) [backend]: " in log and "needs 1 GPU(s)" in log, log[-3000:]
    assert "needs-gpu#" not in log, "a repeated listing of one task is reported once"


def test_no_container_volume_or_network_left(docker_run: tuple[Path, str, str]) -> None:
    _, run_id, _ = docker_run
    assert _left_over(run_id) == {"container": [], "volume": [], "network": []}

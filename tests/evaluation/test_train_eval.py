"""Evaluation during ``miles train tiny-terminal``: dedicated and external modes on a cheap run
(no SFT, 2 groups a step), shared mode on the learning run (the shared warm start, 30 more steps).

Real pieces only: the embedded engines, the TITO session server, local sandboxes, a trainer
process, checkpoints, a real subprocess for the external command.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from miles_engine.cli.main import cli
from miles_engine.errors import ConfigError
from miles_engine.evaluation import stats
from miles_engine.evaluation.runner import per_task_values, read_records

CHEAP = ["run.steps=4", "run.checkpoint_every=2", "run.max_minutes=null", "metrics.progress=false", "sft.enabled=false",
         "tokenizer.corpus_demos=300", "rollout.groups_per_step=2", "rollout.group_size=4", "rollout.max_inflight=8",
         "buffer.capacity_groups=8", "eval.every=2", "eval.limit=4", "eval.attempts=2"]


def train(tmp_path: Path, name: str, *overrides: str) -> tuple[Path, list[dict[str, Any]]]:
    result = CliRunner().invoke(cli, ["train", "tiny-terminal", *overrides, f"run.out_dir={tmp_path}",
                                      f"run.name={name}"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    run = tmp_path / name
    return run, [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def consumed_rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "consumed.jsonl").read_text().splitlines()]


def check_no_group_lost(run: Path, rows: list[dict[str, Any]], steps: int, groups_per_step: int) -> None:
    consumed = consumed_rows(run)
    ids = [g for row in consumed for g in row["groups"]]
    assert [row["step"] for row in consumed] == list(range(1, steps + 1))
    assert all(len(row["groups"]) == groups_per_step for row in consumed) and len(set(ids)) == len(ids)
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert all(r.get("scheduler/groups_discarded_closed", 0) == 0 and r["rollout/failed"] == 0 for r in train_rows)


def eval_rows(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in rows if r["kind"] == "eval"}


def versions_by_step(rows: list[dict[str, Any]]) -> dict[int, int]:
    return {r["step"]: int(r["weights/version"]) for r in rows if r["kind"] == "train"}


@pytest.mark.timeout(600)
def test_dedicated_engine_evaluates_snapshots_while_training(tmp_path: Path) -> None:
    """The default eval engine (one embedded engine of its own, fed by colocated transport); a
    `server` eval engine is evaluated in tests/run/test_fleet_e2e.py (learning run)."""
    run, rows = train(tmp_path, "dedicated", *CHEAP, "eval.mode=dedicated")
    evals = eval_rows(rows)
    assert sorted(evals) == [0, 2, 4]
    versions = versions_by_step(rows)
    for step, row in evals.items():
        expected = versions.get(step, versions[2] - 2 if step == 0 else None)  # v(step 0) = v(step 2) - 2
        assert row["eval/weight_version"] == expected and row["eval/failed"] == 0
        assert 0 <= row["eval/lag_steps"] <= 4 - step
        assert row["eval/version_mismatched_attempts"] == 0 and row["eval/tasks"] == 4 and row["eval/attempts"] == 8
        records = read_records(run / "eval" / f"step_{step:06d}.jsonl")
        assert len(records) == 8 and all(r.weight_versions == [expected] for r in records if r.ok)
        assert all(r.task_id in held_out(run) for r in records)
    trained = {g.split("@")[0] for line in (run / "consumed.jsonl").read_text().splitlines()
               for g in json.loads(line)["groups"]}
    assert not trained & held_out(run)
    check_no_group_lost(run, rows, 4, 2)


def held_out(run: Path) -> set[str]:
    return {json.loads(line)["task_id"] for f in (run / "eval").glob("step_*.jsonl")
            for line in f.read_text().splitlines()}


EXTERNAL = '''
import json, pathlib, sys
ckpt, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
manifest = json.loads((ckpt / "manifest.json").read_text())
tasks = json.loads(pathlib.Path(sys.argv[3]).read_text())["task_ids"][:3]
out.write_text(json.dumps({"metrics": {"step_seen": manifest["step"], "version_seen": manifest["weight_version"]},
                           "tasks": [{"task_id": tasks[0], "reward": 1.0}, {"task_id": tasks[1], "reward": 0.0},
                                     {"task_id": tasks[2], "error": "sandbox crashed"}]}))
'''


@pytest.mark.timeout(600)
def test_external_command_runs_on_each_checkpoint(tmp_path: Path) -> None:
    script = tmp_path / "judge.py"
    script.write_text(EXTERNAL)
    command = json.dumps([sys.executable, str(script), "{checkpoint}", "{output}", "{tasks}"])
    run, rows = train(tmp_path, "external", *CHEAP, "eval.mode=external", f"eval.external.command={command}")
    evals = eval_rows(rows)
    assert sorted(evals) == [0, 2, 4]
    versions = versions_by_step(rows)
    for step, row in evals.items():
        assert row["eval/external/step_seen"] == step and row["eval/failed"] == 0
        if step in versions:
            assert row["eval/external/version_seen"] == row["eval/weight_version"] == versions[step]
        assert row["eval/reward"] == 0.5 and row["eval/errors"] == 1 and row["eval/errors/external"] == 1
        assert json.loads((run / "eval" / f"external_step_{step:06d}.json").read_text())["metrics"]["step_seen"] == step
    assert not list((run / "eval").glob(".external-*"))  # the hard-linked checkpoint copies are removed
    check_no_group_lost(run, rows, 4, 2)
    # resuming with another held-out split is refused before anything starts, naming the key
    result = CliRunner().invoke(cli, ["train", "--resume", str(run), "run.steps=6", "eval.split.fraction=0.3"])
    assert result.exit_code != 0 and isinstance(result.exception, ConfigError)
    assert "the train / eval split of the training environment's tasks would change" in str(result.exception)
    assert "eval.split.fraction: checkpoint 0.1, now 0.3" in str(result.exception)
    assert len(consumed_rows(run)) == 4  # nothing trained


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_shared_eval_held_out_accuracy_rises_and_checkpoints_compare(recipe_run: Path) -> None:
    """The recipe as shipped resumed from its warm start (the session's ``recipe_run``: SFT + 1 RL
    step, then 30 more), held-out eval at the resumed step and every 10 on the training engines. The
    training reward rises 0.3-0.5 over these steps (see the e2e tests); the held-out drills are the
    same distribution, so their reward must rise too: the paired difference step 30 - step 1 over
    the 32 held-out tasks has its 95% interval above 0."""
    run = recipe_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = eval_rows(rows)
    assert sorted(evals) == [1, 10, 20, 30]  # the resumed step (eval.at_start), then every 10
    versions = versions_by_step(rows)
    assert all(evals[s]["eval/lag_steps"] == 0 for s in evals)  # shared: training waits for the eval
    assert all(evals[s]["eval/weight_version"] == versions[s] for s in (10, 20, 30))
    assert all(evals[s]["eval/version_mismatched_attempts"] == 0 for s in evals)
    check_no_group_lost(run, rows, 31, 8)
    # fully_async: the groups generating when an eval starts are retracted and generated again after it
    # (eval.in_flight: auto); the last training row (step 31) counts those of the evals at steps 10, 20 and 30
    retracted = [evals[s]["eval/retracted_groups"] for s in (1, 10, 20, 30)]
    assert retracted[0] == 0  # the resumed step: the rollout has not started
    last_train = [r for r in rows if r["kind"] == "train"][-1]
    assert last_train["step"] == 31 and last_train.get("scheduler/groups_retracted", 0) == sum(retracted[1:])
    first, last = (read_records(run / "eval" / f"step_{s:06d}.jsonl") for s in (1, 30))
    diff = stats.paired_difference(per_task_values(last), per_task_values(first))
    assert diff.n == 32 and diff.low > 0, (diff, {s: round(evals[s]["eval/reward"], 3) for s in evals})
    assert evals[30]["eval/reward_ci_low"] <= evals[30]["eval/reward"] <= evals[30]["eval/reward_ci_high"]
    # "did training help" as one command: both checkpoints on the same held-out tasks
    ckpts = run / "checkpoints"
    result = CliRunner().invoke(cli, ["eval", str(run / "config.yaml"), "eval.limit=32", "eval.attempts=4",
                                      "--checkpoint", str(ckpts / "step_00000001"), "--checkpoint",
                                      str(ckpts / "step_00000030"), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert [r["weight_version"] for r in report["runs"]] == [evals[1]["eval/weight_version"], versions[30]]
    assert report["difference"]["reward"]["tasks"] == 32 and report["difference"]["reward"]["ci_low"] > 0

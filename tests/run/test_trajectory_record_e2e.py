"""A short tiny-terminal run records every trajectory it trained on exactly once, with the token
rows, advantages and log-probs the trainer used (captured from the trainer itself); the default
keeps the bodies of each step's best and worst. Bounded by steps (no SFT: the tiny policy's own
samples), an in-process trainer so the test can watch what it trains on; and one RL step after
the recipe's SFT warm start, where the policy calls tools."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from miles_engine.cli.main import cli
from miles_engine.config.recipe import load_recipe
from miles_engine.hub import default_hub
from miles_engine.metrics.trajectory_records import kept_bodies
from miles_engine.metrics.trajectory_store import TrajectoryStore
from miles_engine.run.driver import run_recipe
from miles_engine.trainer import advantages, torch_trainer
from miles_engine.trainer.step_rows import row_keys

STEPS, GROUPS, GROUP_SIZE = 2, 2, 3
SHORT = ["sft.enabled=false", "tokenizer.corpus_demos=300", "rollout.mode=sync", "placement.trainer=in_process",
         f"rollout.group_size={GROUP_SIZE}", f"rollout.groups_per_step={GROUPS}", "rollout.max_inflight=6",
         "buffer.capacity_groups=4", f"run.steps={STEPS}", "metrics.progress=false"]


def _run(tmp_path: Path, *overrides: str) -> tuple[Path, list[dict[str, Any]]]:
    """The run and, per RL step, what the trainer got: its padded batch, row keys and GRPO advantages."""
    seen: list[dict[str, Any]] = []
    build, grpo = torch_trainer.from_groups, advantages.grpo_advantages

    def from_groups(minibatches, **kw):
        batch = build(minibatches, **kw)
        seen.append({"keys": row_keys(minibatches), "batch": batch})
        return batch

    def grpo_advantages(*a, **kw):
        out = grpo(*a, **kw)
        seen[-1]["advantages"] = out.clone()
        return out

    cfg = load_recipe("tiny-terminal", [*SHORT, *overrides, f"run.out_dir={tmp_path}"], hub=default_hub())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch_trainer, "from_groups", from_groups)
        mp.setattr(advantages, "grpo_advantages", grpo_advantages)
        asyncio.run(run_recipe(cfg, run_dir, hub=default_hub()))
    return run_dir, seen


@pytest.fixture(scope="module")
def all_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    torch.set_num_threads(1)  # what the recipe's in-process trainer sets anyway (trainer.num_threads: 1)
    return _run(tmp_path_factory.mktemp("rec_all"), "metrics.trajectories=all")


@pytest.mark.timeout(300)
def test_every_trained_trajectory_is_recorded_once_as_the_trainer_saw_it(all_run) -> None:
    run_dir, seen = all_run
    store = TrajectoryStore(run_dir)
    store.refresh()
    trained = [s for s in store.summaries if s["filtered"] is None]
    assert store.steps() == list(range(1, STEPS + 1)) and len(seen) == STEPS
    ids = Counter((s["group_id"], s["index"]) for s in trained)
    assert set(ids.values()) == {1}  # each exactly once
    for step, got in enumerate(seen, start=1):
        rows = {(s["group_id"], s["index"]): s for s in trained if s["step"] == step}
        assert sorted(rows) == sorted(got["keys"])  # the step's trained trajectories, all of them
        batch = got["batch"]
        for i, key in enumerate(got["keys"]):
            rec = store.get(rows[key]["rid"])
            n = batch.lengths[i]
            assert rec["has_body"] and rec["tokens"] == n == len(rec["pieces"])
            assert rec["token_ids"] == batch.token_ids[i, :n].tolist()
            assert rec["loss_mask"] == batch.loss_mask[i, :n].int().tolist()
            assert rec["rollout_logprobs"] == pytest.approx((batch.rollout_logp[i, :n]).tolist(), abs=1e-6)
            assert rec["advantage"] == pytest.approx(float(got["advantages"][i]), abs=1e-6)  # what the trainer used
            sampled = [p for p, m in zip(rec["trainer_logprobs"], rec["loss_mask"]) if m]
            assert sampled and all(x is not None and x <= 0 for x in sampled)  # the trainer's own log-probs
            assert rec["gap_mean"] is not None and 0 <= rec["gap_mean"] <= rec["gap_max"]
            assert rec["weight_version"] == step and rec["kind"] in ("echo", "calc")
            assert [m["role"] for m in rec["messages"][:3]] == ["system", "user", "assistant"]
            assert all(c["exit_code"] is not None or c["truncated"] or c.get("timed_out") for c in rec["commands"])
            assert rec["versions"] is not None and rec["versions"][0] <= rec["versions"][1]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    per_step = Counter(s["step"] for s in store.summaries)
    assert [r["metrics/trajectory_records"] for r in train] == [per_step[r["step"]] for r in train]
    assert all(r["metrics/trajectory_bytes"] > 0 and r["time/record_trajectories"] > 0 for r in train)
    assert sum(r["metrics/trajectory_bytes"] for r in train) == (run_dir / "trajectories.mtr").stat().st_size


@pytest.mark.timeout(300)
def test_by_default_each_step_keeps_the_bodies_of_its_best_and_worst(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    run_dir, seen = _run(tmp_path)
    store = TrajectoryStore(run_dir)
    store.refresh()
    for step, got in enumerate(seen, start=1):
        rows = [s for s in store.summaries if s["step"] == step and s["filtered"] is None]
        assert len(rows) == len(got["keys"]) == GROUPS * GROUP_SIZE  # every summary
        as_trained = [SimpleNamespace(reward=s["reward"], group_id=s["group_id"], index=s["index"]) for s in rows]
        want = kept_bodies(as_trained, "best_worst", seed=0, step=step)  # type: ignore[arg-type]
        assert len(want) == 2
        assert {(s["group_id"], s["index"]) for s in rows if s["has_body"]} == want
        assert all(bool(store.get(s["rid"]).get("token_ids")) == s["has_body"] for s in rows)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_trained_policy_records_its_tool_calls_and_the_sandbox_commands(warm_run: Path, tmp_path: Path) -> None:
    """After the recipe's SFT warm start (the shared ``warm_run``, resumed for one more RL step)
    the policy calls ``bash``: multi-turn conversations and commands with exit codes on record."""
    run = tmp_path / "sft"
    shutil.copytree(warm_run, run)
    args = ["train", "--resume", str(run), "run.steps=2", "run.max_minutes=null", "metrics.progress=false",
            "metrics.trajectories=all"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    store = TrajectoryStore(run)
    store.refresh()
    assert store.steps()[-1:] == [2] and set(store.steps()) <= {1, 2}  # the warm run's step 1, if it recorded
    trained = [s for s in store.summaries if s["filtered"] is None and s["step"] > 1]
    assert len({(s["group_id"], s["index"]) for s in trained}) == len(trained) == 64  # 8 groups of 8
    multi = [store.get(s["rid"]) for s in trained if s["tool_calls"] > 0 and s["turns"] > 1]
    assert multi, "no multi-turn tool-using trajectory recorded"
    for rec in multi:
        roles = [m["role"] for m in rec["messages"]]
        assert roles[:2] == ["system", "user"] and "tool" in roles and roles.count("assistant") >= 2
        calls = [c for m in rec["messages"] for c in m.get("tool_calls") or []]
        assert calls and all({"id", "function"} <= set(c) and "name" in c["function"] for c in calls)  # OpenAI's shape
        agent = [c for c in rec["commands"] if c["phase"] == "agent"]
        assert agent and all(isinstance(c["exit_code"], int) or c["timed_out"] for c in agent)
        assert all(c["output"] is not None and c["duration_s"] >= 0 for c in agent)
    # the dashboard reads this real run: the step's groups, and a recorded trajectory token by token
    from fastapi.testclient import TestClient

    from miles_engine.dashboard.app import create_app

    rec = multi[0]
    with TestClient(create_app([run])) as client:
        assert client.get("/").status_code == 200
        step_page = client.get("/run/0/step/2")
        assert step_page.status_code == 200 and rec["group_id"] in step_page.text
        page = client.get(f"/run/0/traj/{rec['rid']}")
        assert page.status_code == 200
        assert all(c["function"]["name"] in page.text for m in rec["messages"] for c in m.get("tool_calls") or [])
        assert rec["commands"][0]["command"].split()[0] in page.text
        assert f"{len(rec['token_ids'])} tokens" in page.text

"""The packaged tiny-math recipe (the dataset environment, math-answer, GRPO) as a user runs it:
it learns (the held-out reward after 30 RL steps above the SFT weights', paired over the recipe's
held-out problems: tests/run/learning.py), and a run stopped and resumed trains exactly the groups
of an uninterrupted run, step by step (the data cursor resumes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from miles_engine.cli.main import cli
from tests.run.learning import assert_held_out_rise

QUIET = ["run.max_minutes=null", "metrics.progress=false"]  # bounded by steps, not by the clock


def train(*args: str) -> None:
    result = CliRunner().invoke(cli, ["train", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output


def rows(run: Path, kind: str) -> list[dict]:
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in metrics if r["kind"] == kind]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_math_learns(tmp_path: Path) -> None:
    data = tmp_path / "arithmetic.jsonl"
    train("tiny-math", *QUIET, "run.steps=30", f"environment.options.path={data}",
          f"eval.environment.options.path={data}", "eval.every=30", f"run.out_dir={tmp_path}", "run.name=math")
    run = tmp_path / "math"
    sft, steps = rows(run, "sft"), rows(run, "train")
    assert sft[-1]["sft/loss"] < 0.5 * sft[0]["sft/loss"]
    assert len(steps) == 30, steps
    # the recipe's 32 held-out problems x 4 attempts at the first step (the SFT weights) and at step 30
    assert_held_out_rise(run, steps, " (tiny-math)")
    assert all(r["rollout/failed"] == 0 for r in steps)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert all(r["completion"] for r in samples)


FAST = ["sft.enabled=false", "tokenizer.corpus_demos=300", "environment.options.generate.rows=200",
        "rollout.group_size=2", "rollout.groups_per_step=3", "rollout.max_inflight=6", "run.checkpoint_every=1"]


def consumed(run: Path) -> list[tuple[int, list[str]]]:
    lines = [json.loads(line) for line in (run / "consumed.jsonl").read_text().splitlines()]
    return [(r["step"], sorted(r["groups"])) for r in lines]


@pytest.mark.timeout(300)
def test_a_resumed_run_continues_the_data_cursor_exactly(tmp_path: Path) -> None:
    data = f"environment.options.path={tmp_path / 'arithmetic.jsonl'}"
    train("tiny-math", *QUIET, *FAST, data, "run.steps=4", f"run.out_dir={tmp_path}", "run.name=whole")
    train("tiny-math", *QUIET, *FAST, data, "run.steps=2", f"run.out_dir={tmp_path}", "run.name=cut")
    train("--resume", str(tmp_path / "cut"), "run.steps=4")
    whole, cut = consumed(tmp_path / "whole"), consumed(tmp_path / "cut")
    assert [s for s, _ in whole] == [1, 2, 3, 4]
    assert cut == whole  # the same groups (task id @ stream position) in the same steps
    positions = [int(g.rsplit("@", 1)[1]) for _, groups in whole for g in groups]
    assert sorted(positions) == list(range(12))  # the cursor went on from where it stopped: nothing twice or lost

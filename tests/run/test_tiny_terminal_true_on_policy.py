"""The packaged tiny-terminal recipe with trainer.true_on_policy (the engine's is derived from it)
and sync rollouts, so every RL step trains only tokens sampled under the trainer's current weights
(under the recipe's fully_async a step may train only tokens one version old, which measure
staleness, not numerics): at every step the numerics gap is exactly 0.0, no token is stale and the
importance ratio is exactly 1. And the recipe still learns (the tiny-terminal e2e's bar,
tests/run/learning.py: the held-out reward after 30 steps above the SFT weights', paired).
Bounded by steps: the recipe's full SFT warm start (the shared ``warm_run``, resumed from its
step-0 checkpoint: the SFT weights, before any rollout), 30 RL steps, the wall-clock limit lifted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from miles_engine.cli.main import cli
from tests.run.learning import EVAL_FIRST_AND_LAST, assert_held_out_rise

STEPS = 30


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_terminal_true_on_policy_learns_with_zero_numerics_gap_at_every_step(warm_run: Path,
                                                                                    tmp_path: Path) -> None:
    run = tmp_path / "top"
    shutil.copytree(warm_run, run)
    shutil.rmtree(run / "checkpoints" / "step_00000001")  # from the SFT weights: every RL step in this mode
    (run / "metrics.jsonl").write_text("")  # this run's rows only
    args = ["train", "--resume", str(run), "trainer.true_on_policy=true", "rollout.mode=sync", f"run.steps={STEPS}",
            "run.max_minutes=null", "run.checkpoint_every=10", "metrics.progress=false", *EVAL_FIRST_AND_LAST]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == STEPS, [r.get("step") for r in train]
    for r in train:
        assert r["tis/numerics_tokens"] > 0 and r["tis/stale_tokens"] == 0, r
        assert r["tis/numerics_max_abs_diff"] == 0.0 and r["tis/numerics_abs_diff"] == 0.0, r
        assert r["tis/ratio_min"] == r["tis/ratio_max"] == 1.0, r
    assert_held_out_rise(run, train, " with the mode on")

"""The packaged tiny-terminal recipe with trainer.true_on_policy (the engine's is derived from it),
resumed from the session's warm run (its SFT warm start + one RL step; the mode may be switched on
at a resume: only the rounding changes). At every RL step the numerics gap is exactly 0.0: tokens
sampled under the trainer's current weights score identically on both sides; whatever gap remains
is on stale tokens (under fully_async a step may train only tokens of the previous version, when the
trainer is the slower side). And the recipe still learns: the fleet and Ray e2e tests' margin from
the same warm start (3-step moving average of the reward rises by 0.3 within 30 steps). Bounded by
steps (the wall-clock limit is lifted)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.train.fleet_helpers import metric_rows, moving_average, train_cli

STEPS = 30


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_terminal_true_on_policy_learns_with_zero_numerics_gap(warm_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "top"
    shutil.copytree(warm_run, run)
    proc = train_cli(["--resume", str(run), "trainer.true_on_policy=true", f"run.steps={1 + STEPS}",
                      "run.max_minutes=null", "metrics.progress=false"], timeout=840)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    train = [r for r in metric_rows(run) if r["step"] > 1]  # the RL steps with the mode on
    assert len(train) == STEPS, [r["step"] for r in train]
    tokens = [(r["tis/numerics_tokens"], r["tis/stale_tokens"]) for r in train]
    assert sum(n for n, _ in tokens) > 0, f"no step trained tokens of its own version: {tokens}"
    for r in train:
        if r["tis/numerics_tokens"]:
            assert r["tis/numerics_max_abs_diff"] == 0.0 and r["tis/numerics_abs_diff"] == 0.0, r
    ma = moving_average([r["reward/mean"] for r in train])
    assert max(ma) - ma[0] >= 0.3, f"3-step moving average did not rise by 0.3 with the mode on: {ma}"

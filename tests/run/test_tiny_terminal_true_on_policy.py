"""The packaged tiny-terminal recipe with trainer.true_on_policy (the engine's is derived from it)
and sync rollouts, so every RL step trains only tokens sampled under the trainer's current weights
(under the recipe's fully_async a step may train only tokens one version old, which measure
staleness, not numerics): at every step the numerics gap is exactly 0.0, no token is stale and the
importance ratio is exactly 1. And the recipe still learns (the tiny-terminal e2e's bar,
tests/run/learning.py: the held-out reward after 30 steps above the SFT weights', paired).
Bounded by steps: the recipe's full SFT warm start (the shared ``warm_run``, resumed from its
step-0 checkpoint: the SFT weights, before any rollout), 30 RL steps, the wall-clock limit lifted."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.run.learning import assert_held_out_rise, rl_from_sft_weights

STEPS = 30


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_terminal_true_on_policy_learns_with_zero_numerics_gap_at_every_step(warm_run: Path,
                                                                                    tmp_path: Path) -> None:
    run = tmp_path / "top"
    train = rl_from_sft_weights(warm_run, run, STEPS, "trainer.true_on_policy=true", "rollout.mode=sync",
                                "run.checkpoint_every=10")
    for r in train:
        assert r["tis/numerics_tokens"] > 0 and r["tis/stale_tokens"] == 0, r
        assert r["tis/numerics_max_abs_diff"] == 0.0 and r["tis/numerics_abs_diff"] == 0.0, r
        assert r["tis/ratio_min"] == r["tis/ratio_max"] == 1.0, r
    assert_held_out_rise(run, train, " with the mode on")

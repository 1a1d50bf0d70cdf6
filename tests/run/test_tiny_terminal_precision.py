"""The packaged tiny-terminal recipe under the precision contract, from the SFT weights (the shared
``warm_run``'s step-0 checkpoint), 30 RL steps, and the tiny-terminal e2e's learning bar
(tests/run/learning.py: the held-out reward after 30 steps above the SFT weights', paired):

- ``precision.rollout=fp8 precision.kv_cache=fp8``: "full-precision train + FP8 serve" -- the
  engines compute with the FP8 (128x128 block) values of the trainer's weights and an FP8 KV cache;
  the train-rollout log-prob gap on the sampled tokens is what the mismatch correction sees.
- ``precision.train=mxfp8 precision.rollout=mxfp8``: quantisation-aware training -- the trainer's
  forward computes with the very MXFP8 values the engines hold, so the gap shrinks to the float
  noise of two forward implementations.
Sync rollouts, so every token is sampled under the trainer's current weights (the gap then
measures numerics, not staleness)."""

from __future__ import annotations

from pathlib import Path
from statistics import median

import pytest

from tests.run.learning import assert_held_out_rise, rl_from_sft_weights

STEPS = 30


def _train(warm_run: Path, run: Path, *overrides: str) -> list[dict]:
    return rl_from_sft_weights(warm_run, run, STEPS, *overrides, "rollout.mode=sync", "run.checkpoint_every=30")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fp8_serve_and_mxfp8_quantisation_aware_training_learn(warm_run: Path, tmp_path: Path) -> None:
    serve = _train(warm_run, tmp_path / "fp8", "precision.rollout=fp8", "precision.kv_cache=fp8")
    assert "precision" in (tmp_path / "fp8" / "config.yaml").read_text()
    assert_held_out_rise(tmp_path / "fp8", serve, " with FP8 serving")
    qat = _train(warm_run, tmp_path / "mxfp8", "precision.train=mxfp8", "precision.rollout=mxfp8")
    assert_held_out_rise(tmp_path / "mxfp8", qat, " with MXFP8 quantisation-aware training")
    gap_serve = median(r["tis/numerics_abs_diff"] for r in serve)
    gap_qat = median(r["tis/numerics_abs_diff"] for r in qat)
    assert all(r["tis/numerics_tokens"] > 0 for r in serve + qat)
    # the trainer computes with the engine's values under QAT; with FP8 serving it does not
    assert gap_qat * 10 < gap_serve, (gap_qat, gap_serve)

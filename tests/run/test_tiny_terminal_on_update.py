"""Partial rollouts: tiny-terminal, fully async, with ``rollout.on_update=in_place`` — a push lands
while episodes generate and the running requests go on with the new weights, KV kept (no
re-prefill, no retraction). Every token keeps the version that sampled it, so trajectories span
versions (``buffer/taken/delta_gen``), the mismatch correction sees those tokens as stale, per
token, and the run learns (the held-out bar of tests/run/learning.py). ``retract`` (the default)
learns in test_tiny_terminal_e2e.py; ``wait`` and ``abort`` run a few steps here, every group
accounted for. From the SFT weights of the shared ``warm_run``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.run.fleet_helpers import assert_accounted
from tests.run.learning import assert_held_out_rise, rl_from_sft_weights


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_in_place_partial_rollouts_learn(warm_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "in_place"
    train = rl_from_sft_weights(warm_run, run, 30, "rollout.on_update=in_place", "run.checkpoint_every=30")
    assert_held_out_rise(run, train, " with rollout.on_update=in_place")
    assert all(r["engine/retracted"] == 0 for r in train)  # in place: nothing put back
    spans = [r.get("buffer/taken/delta_gen_max", 0.0) for r in train]
    assert max(spans) >= 1, f"no trajectory spanned a push: {spans}"
    assert sum(r.get("tis/stale_tokens", 0) for r in train) > 0  # per-token versions reach the correction
    assert all(r["rollout/failed"] == 0 for r in train)
    assert_accounted(run, train)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_wait_and_abort_run_with_every_group_accounted(warm_run: Path, tmp_path: Path, mode: str) -> None:
    run = tmp_path / mode
    train = rl_from_sft_weights(warm_run, run, 6, f"rollout.on_update={mode}",
                                "run.checkpoint_every=6")
    assert all(r["engine/retracted"] == 0 for r in train)
    if mode == "wait":  # a request finishes on the weights it started with: none is cut
        assert all(r["engine/aborted"] == 0 for r in train)
    assert_accounted(run, train)

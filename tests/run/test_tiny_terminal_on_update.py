"""Partial rollouts: tiny-terminal, fully async, with ``rollout.on_update=in_place`` — a push lands
while episodes generate and the running requests go on with the new weights, KV kept (no
re-prefill, no retraction). Every token keeps the version that sampled it, so trajectories span
versions (``buffer/taken/delta_gen``), the mismatch correction sees those tokens as stale, per
token, and the run learns (the held-out bar of tests/run/learning.py); through an engine SIGKILL on a
fleet: tests/run/test_fleet_in_place.py. ``retract`` (the default)
learns in test_tiny_terminal_e2e.py; ``abort`` learns here too, ``wait`` runs a few steps, every
group accounted for. From the SFT weights of the shared ``warm_run``."""

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
def test_wait_runs_with_every_group_accounted(warm_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "wait"
    train = rl_from_sft_weights(warm_run, run, 6, "rollout.on_update=wait", "run.checkpoint_every=6")
    assert all(r["engine/retracted"] == 0 for r in train)
    assert all(r["engine/aborted"] == 0 for r in train)  # a request finishes on the weights it started with
    assert_accounted(run, train)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_abort_learns_with_every_group_accounted(warm_run: Path, tmp_path: Path) -> None:
    """A push cuts the running requests short (their episodes end as the engine's abort): the run
    still learns to the held-out bar, and every group is trained once or accounted as dropped."""
    run = tmp_path / "abort"
    train = rl_from_sft_weights(warm_run, run, 30, "rollout.on_update=abort", "run.checkpoint_every=30")
    assert_held_out_rise(run, train, " with rollout.on_update=abort")
    assert all(r["engine/retracted"] == 0 for r in train)
    assert sum(r["engine/aborted"] for r in train) > 0, "no push ever cut a running request"
    assert_accounted(run, train)


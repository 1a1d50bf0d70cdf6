"""End to end at toy scale: the packaged tiny-terminal recipe, shortened, must learn.

Real pieces only: a BPE trained at start-up, SFT on noisy demonstrations, the embedded engine,
the TITO session server over HTTP, local sandbox subprocesses, a trainer in its own process,
weight pushes every step. The recipe runs as shipped (both drills, its full SFT warm start: a
shorter or single-drill SFT leaves a weaker start whose RL rise over ~20 steps sits right at
the margin), only with fewer RL steps: 31 of its 60, and held-out evaluations at the first step
and every 10. Asserts the learning bar of tests/run/learning.py (held-out reward up, paired, 95%
interval above 0), not exact values.

The recipe's first command (SFT warm start and RL step 1) is the session's shared ``warm_run``
(the same ``miles train tiny-terminal``, stopped after one step); the session's ``recipe_run``
resumes a copy of it for 30 more RL steps (tests/run/fleet_helpers.py: ``make_recipe_run``), the
run this test and tests/evaluation/test_train_eval.py read, so the suite runs the recipe once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.run.fleet_helpers import RECIPE_STEPS
from tests.run.learning import assert_held_out_rise


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_terminal_recipe_learns(recipe_run: Path) -> None:
    run = recipe_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    sft = [r for r in rows if r["kind"] == "sft"]
    train = [r for r in rows if r["kind"] == "train"]
    assert sft and sft[-1]["sft/loss"] < sft[0]["sft/loss"]
    rewards = [r["reward/mean"] for r in train]
    assert [r["step"] for r in train] == list(range(1, RECIPE_STEPS + 1)), rewards
    seen = {k: [round(r.get(k) or 0.0, 2) for r in train] for k in ("reward/echo", "reward/calc", "buffer/taken/s_old_avg")}
    assert_held_out_rise(run, train, f" (per step: {seen})")
    assert all(r["rollout/failed"] == 0 for r in train)
    assert all(r.get("tito/mismatch_bug_rate", 0.0) == 0.0 for r in train)
    diagnosed, samples = sum(r["tito/diagnosed"] for r in train), sum(r["rollout/num_samples"] for r in train)
    assert 0 < diagnosed < samples / 4, (diagnosed, samples)  # session_server.diagnose_every: 8
    assert all("tis/ratio_mean" in r for r in train)
    assert any(r["engine/mean_decode_batch"] > 1 for r in train)  # the embedded engine batches episodes  # where the report's TIS panel reads it
    assert max(r["weights/version"] for r in train) > train[0]["weights/version"]  # pushed every step
    assert (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir())
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in samples] == [r["step"] for r in train for _ in range(2)]
    assert all(r["completion"] and r["sampled_tokens"] > 0 for r in samples)
    assert any("<tool_call>" in r["completion"] for r in samples)  # the policy's own words, decoded

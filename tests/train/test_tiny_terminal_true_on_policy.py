"""The packaged tiny-terminal recipe with trainer.true_on_policy (the engine's is derived from it):
every RL step's numerics gap is exactly 0.0 (tokens sampled under the trainer's current weights
score identically on both sides); whatever gap remains is on stale tokens. Bounded by steps
(a short SFT warm start, 3 RL steps); the recipe's wall-clock limit is lifted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from miles_engine.cli.main import cli


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_terminal_true_on_policy_numerics_gap_is_zero(tmp_path: Path) -> None:
    args = ["train", "tiny-terminal", "trainer.true_on_policy=true", "run.steps=3", "run.max_minutes=null",
            "run.checkpoint_every=10", "metrics.progress=false", "sft.demos=200", "sft.epochs=1",
            f"run.out_dir={tmp_path}", "run.name=top"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "top" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 3, [r.get("step") for r in train]
    for r in train:
        assert r["tis/numerics_tokens"] + r["tis/stale_tokens"] > 0
        if r["tis/numerics_tokens"]:
            assert r["tis/numerics_max_abs_diff"] == 0.0 and r["tis/numerics_abs_diff"] == 0.0, r
    assert sum(r["tis/numerics_tokens"] for r in train) > 0

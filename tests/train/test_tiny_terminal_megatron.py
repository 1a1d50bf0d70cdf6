"""The tiny-terminal recipe on trainer.backend=megatron, end to end at a fraction of its length:
the stack builds the Megatron ranks, the SFT warm start lowers the loss, RL steps train on real
rollouts and push checked weights to the engine every step, and a checkpoint is written.

Not the "learns" bar of test_tiny_terminal_e2e.py: the recipe's full warm start (938 SFT steps)
costs ~35 min through the Megatron ranks on a 2-core box (~2.3 s a step), so this runs 10 SFT
steps and 2 RL steps (~2 min)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("megatron.core")

from miles_engine.cli.main import cli  # noqa: E402

SHORT = ["trainer.backend=megatron", "sft.demos=320", "sft.epochs=1", "trainer.sft.lr_schedule.total_steps=10",
         "trainer.sft.lr_schedule.warmup_steps=2", "run.steps=2", "run.checkpoint_every=2", "run.max_minutes=null",
         "metrics.progress=false", "weights.check_update_equal=true"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_terminal_runs_on_the_megatron_backend(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["train", "tiny-terminal", *SHORT, f"run.out_dir={tmp_path}", "run.name=mg"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    run = tmp_path / "mg"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    sft = [r for r in rows if r["kind"] == "sft"]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(sft) == 10 and sft[-1]["sft/loss"] < 0.8 * sft[0]["sft/loss"]
    assert len(train) == 2 and all(r["rollout/failed"] == 0 for r in train)
    assert all(r["weights/tensors_checked"] > 0 for r in train)  # every push verified tensor by tensor
    assert train[1]["weights/version"] > train[0]["weights/version"]  # pushed every step
    assert all(math.isfinite(r["train/grad_norm"]) and r["train/tokens"] > 0 for r in train)
    assert (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir())

"""The packaged tiny-sft-then-rl recipe, shortened: the shell drills' demonstrations are exported
as chat transcripts (tool calls and results), the policy is SFT-ed on them (the loss falls, the
held-out eval loss is logged), and RL starts from those weights: the SFT-ed policy makes its own
tool calls (a fresh random policy does not form one). The recipe's full SFT and
its RL rise are what `miles train tiny-sft-then-rl` runs; here both are cut to a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from miles_engine.cli.main import cli


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_sft_then_rl_warm_starts_rl_from_the_transcripts(tmp_path: Path) -> None:
    transcripts = tmp_path / "drills.jsonl"
    short = [f"sft.dataset.path={transcripts}", "sft.dataset.export_demos.n=800", "sft.epochs=1",
             "trainer.sft.lr_schedule.total_steps=25", "sft.dataset.eval_every=10",
             "run.steps=2", "run.checkpoint_every=0", "run.max_minutes=null", "metrics.progress=false"]
    result = CliRunner().invoke(cli, ["train", "tiny-sft-then-rl", *short, f"run.out_dir={tmp_path}", "run.name=r"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    exported = [json.loads(line) for line in transcripts.read_text().splitlines()]
    assert len(exported) == 800 and any(m.get("tool_calls") for m in exported[0]["messages"])
    metrics = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    sft = [r for r in metrics if r["kind"] == "sft"]
    train = [r for r in metrics if r["kind"] == "train"]
    assert sft[-1]["sft/loss"] < 0.5 * sft[0]["sft/loss"]
    evals = [r["sft/eval_loss"] for r in sft if "sft/eval_loss" in r]
    assert len(evals) >= 2 and evals[-1] < evals[0]
    assert sft[0]["sft/eval_rows"] > 0 and sft[0]["sft/bad_rows"] == 0
    assert len(train) == 2 and all(r["rollout/failed"] == 0 for r in train)
    # its own tool calls, learnt from the transcripts in 25 SFT steps (measured 0.11 of episodes; the recipe's
    # full SFT does far better): a policy that RL had started from random weights forms none
    assert max(r["rollout/tool_use_rate"] for r in train) > 0, [r["rollout/tool_use_rate"] for r in train]

"""`miles train` with trainer.backend=megatron and trainer.megatron.checkpoint_format=dist: the ranks
write their shards into each staged checkpoint; `--resume` with another layout (TP=2 over 2 ranks ->
TP=1 on 1) continues exactly like the uninterrupted run (same groups, same step-3 loss); the torch
backend refuses the checkpoint with one error before anything starts (conversion to HF:
tests/trainer/test_megatron_dist_checkpoint.py; this recipe's policy has no model source to export onto)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from miles_engine.cli.main import cli
from miles_engine.errors import ConfigError
from miles_engine.train import consumed

pytest.importorskip("megatron.core")

FAST = ["sft.enabled=false", "tokenizer.corpus_demos=500", "rollout.mode=sync", "placement.trainer=subprocess",
        "rollout.group_size=4", "rollout.groups_per_step=2", "rollout.max_inflight=8", "buffer.capacity_groups=4",
        "run.checkpoint_every=1", "metrics.progress=false", "trainer.backend=megatron",
        "trainer.megatron.checkpoint_format=dist"]
TP2 = ["trainer.parallel.world_size=2", "trainer.megatron.tensor_parallel=2"]


def train(*args: str) -> None:
    result = CliRunner().invoke(cli, ["train", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output


def train_rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
    return {r["step"]: r for r in rows if r["kind"] == "train"}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_dist_checkpoint_resumes_through_the_cli_at_another_tp_exactly(tmp_path: Path) -> None:
    train("tiny-terminal", *FAST, *TP2, "run.steps=3", f"run.out_dir={tmp_path}", "run.name=base")
    train("tiny-terminal", *FAST, *TP2, "run.steps=2", f"run.out_dir={tmp_path}", "run.name=r")
    run = tmp_path / "r"
    ckpt = run / "checkpoints" / "step_00000002"
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert any(f.startswith("megatron_dist/") and f.endswith(".distcp") for f in files)
    assert (ckpt / "megatron_dist" / "metadata.json").is_file()
    with pytest.raises(ConfigError, match="Megatron's distributed format.*trainer.backend=megatron"):
        CliRunner().invoke(cli, ["train", "--resume", str(run), "trainer.backend=torch"], catch_exceptions=False)
    train("--resume", str(run), "run.steps=3", "trainer.parallel.world_size=1", "trainer.megatron.tensor_parallel=1")
    base, resumed = consumed.read(tmp_path / "base"), consumed.read(run)
    assert [(r["step"], sorted(r["groups"])) for r in resumed] == [(r["step"], sorted(r["groups"])) for r in base]
    a, b = train_rows(tmp_path / "base")[3], train_rows(run)[3]
    assert b["weights/version"] == a["weights/version"]
    for key in ("train/loss", "train/grad_norm", "train/lr"):
        assert b[key] == pytest.approx(a[key], abs=1e-4), key

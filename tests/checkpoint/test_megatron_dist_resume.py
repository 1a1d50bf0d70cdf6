"""`miles train` with trainer.backend=megatron and trainer.megatron.checkpoint_format=dist: the ranks
write their shards into each staged checkpoint; a run SIGKILLed once step 2's shards are written
(checkpoint not complete) resumes from step 1 with another layout (TP=2 over 2 ranks -> TP=1 on 1)
and continues exactly like the uninterrupted run (same groups, same step 2-3 losses); the torch
backend refuses the checkpoint with one error before anything starts (conversion to HF:
tests/trainer/test_megatron_dist_checkpoint.py; this recipe's policy has no model source to export onto)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from miles_engine.cli.main import cli
from miles_engine.errors import ConfigError
from miles_engine.checkpoint import consumed

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
    # killed once step 2's shards are written, before its checkpoint is complete: resume takes step 1's
    cmd = [sys.executable, "-m", "miles_engine.cli.main", "train", "tiny-terminal", *FAST, *TP2, "run.steps=3",
           f"run.out_dir={tmp_path}", "run.name=r"]
    killed = subprocess.run(cmd, env={**os.environ, "MILES_TEST_CRASH_AT": "checkpoint_write@2"},
                            capture_output=True, text=True, timeout=900)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    run = tmp_path / "r"
    staged = [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-step_00000002")]
    assert len(staged) == 1 and (staged[0] / "megatron_dist" / "metadata.json").is_file()
    assert not (staged[0] / "manifest.json").exists()
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000000", "step_00000001"]
    ckpt = run / "checkpoints" / "step_00000001"
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert any(f.startswith("megatron_dist/") and f.endswith(".distcp") for f in files)
    assert (ckpt / "megatron_dist" / "metadata.json").is_file()
    with pytest.raises(ConfigError, match="Megatron's distributed format.*trainer.backend=megatron"):
        CliRunner().invoke(cli, ["train", "--resume", str(run), "trainer.backend=torch"], catch_exceptions=False)
    train("--resume", str(run), "trainer.parallel.world_size=1", "trainer.megatron.tensor_parallel=1")
    assert not list((run / "checkpoints").glob(".tmp-*"))
    base, resumed = consumed.read(tmp_path / "base"), consumed.read(run)
    assert [(r["step"], sorted(r["groups"])) for r in resumed] == [(r["step"], sorted(r["groups"])) for r in base]
    for step in (2, 3):  # retrained on TP=1 from the TP=2 checkpoint of step 1
        a, b = train_rows(tmp_path / "base")[step], train_rows(run)[step]
        assert b["weights/version"] == a["weights/version"]
        for key in ("train/loss", "train/grad_norm", "train/lr"):
            assert b[key] == pytest.approx(a[key], abs=1e-4), (step, key)

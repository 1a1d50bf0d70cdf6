"""tiny-terminal with ``weights.transport=p2p``: the trainer ranks write the weights straight into
two engine processes (``engines.0.kind=server``), nothing of them passing through the driver.
Two FSDP2 ranks -> two engines (one to one), every push checked equal; and from the SFT weights
of the shared ``warm_run`` (one rank -> two engines) the run learns (the held-out bar)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run.learning import assert_held_out_rise, rl_from_sft_weights

REPO = Path(__file__).resolve().parents[2]
P2P = ["engines.0.kind=server", "engines.0.replicas=2", "weights.transport=p2p"]
SHORT = ["weights.check_update_equal=true", "sft.demos=64", "sft.epochs=1", "tokenizer.corpus_demos=200",
         "rollout.groups_per_step=2", "rollout.max_inflight=8", "metrics.progress=false", "run.max_minutes=null"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_trainer_ranks_write_to_two_engines_checked_every_push(tmp_path: Path) -> None:
    args = ["train", "tiny-terminal", *P2P, *SHORT, "trainer.parallel.world_size=2", "run.steps=3",
            f"run.out_dir={tmp_path}", "run.name=p2p"]
    proc = subprocess.run([sys.executable, "-m", "miles_engine.cli.main", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=850, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "p2p" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"]
    assert len(train) == 3
    for r in train:
        assert r["weights/engines"] == 2 and r["weights/driver_bytes"] == 0  # the bytes went rank -> engine
        assert r["weights/tensors_checked"] == 2 * r["weights/tensors"]  # every tensor on both engines
        assert r["weights/bytes_pushed"] > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_p2p_run_learns(warm_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "p2p"
    train = rl_from_sft_weights(warm_run, run, 30, *P2P, "run.checkpoint_every=30")
    assert_held_out_rise(run, train, " with weights.transport=p2p")
    assert all(r["weights/driver_bytes"] == 0 and r["weights/engines"] == 2 for r in train)

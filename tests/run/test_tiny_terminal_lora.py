"""tiny-terminal with LoRA, as a user turns it on (``trainer.lora.enabled=true``): ``weights.lora=auto``
picks adapter-only pushes for the embedded engine, so every push carries each adapted module's A, B
and scaling -- the adapter's bytes, not the merged weights' -- and check-weight-update-equal finds
the engine holding exactly the merged weights after each one; a resumed run (a fresh engine, which
keeps its base again) pushes and checks the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
REPO = Path(__file__).resolve().parents[2]
SHORT = ["trainer.lora.enabled=true", "weights.check_update_equal=true", "sft.demos=64", "sft.epochs=1",
         "tokenizer.corpus_demos=200", "rollout.groups_per_step=2", "rollout.max_inflight=8", "metrics.progress=false",
         "run.max_minutes=null"]
LAYERS, RANK, MODULES = 2, 8, 7  # tiny-terminal's model; trainer.lora's default rank and target modules


def _train(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "miles_engine.cli.main", "train", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def _adapter_bytes() -> int:
    hidden, kv, inter = 128, 2 * 32, 384  # q, k, v, o, gate, up, down: in + out of each
    per_layer = sum(i + o for i, o in ((hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden),
                                       (hidden, inter), (hidden, inter), (inter, hidden)))
    return LAYERS * (RANK * per_layer * 4 + MODULES * 8)  # float32 A and B, a float64 scaling per module


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lora_run_pushes_only_adapters_checked_equal_and_resumes(tmp_path: Path) -> None:
    run = tmp_path / "lora"
    _train("tiny-terminal", *SHORT, "run.steps=2", f"run.out_dir={tmp_path}", "run.name=lora")
    _train("--resume", str(run), "run.steps=3")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    modules = LAYERS * MODULES
    for r in train:
        assert r["weights/tensors"] == 3 * modules  # A, B and the scaling of each adapted module
        assert r["weights/bytes_pushed"] == _adapter_bytes()
        assert r["weights/tensors_checked"] == 4 * modules  # the parts and the merged weight they give
    versions = [r["weights/version"] for r in train]
    assert versions == sorted(versions) and len(set(versions)) == 3
    config = (run / "config.yaml").read_text()
    assert "lora: auto" in config and "push:" not in config

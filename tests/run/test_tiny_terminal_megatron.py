"""The tiny-terminal recipe learns on trainer.backend=megatron: the shared warm run (the recipe's SFT
warm start and one RL step on the torch backend, tests/conftest.py) resumes on the Megatron
backend - its checkpoint moves between the backends - and 30 RL steps raise the reward by the same
bar as test_tiny_terminal_e2e.py, with real rollouts and checked weight pushes every step.

The warm start itself runs on the torch backend: the recipe's 938 SFT steps cost ~35 min through
the Megatron ranks on a 2-core box; the Megatron SFT step is checked against the torch backend's
in tests/trainer/test_megatron_backend.py."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from tests.run.fleet_helpers import metric_rows, train_cli  # noqa: E402
from tests.run.learning import EVAL_FIRST_AND_LAST, assert_held_out_rise  # noqa: E402

RESUME = ["trainer.backend=megatron", "run.steps=31", "run.checkpoint_every=10", "run.max_minutes=null",
          "metrics.progress=false", "weights.check_update_equal=true", *EVAL_FIRST_AND_LAST]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_terminal_learns_on_the_megatron_backend(warm_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "mg"
    shutil.copytree(warm_run, run)
    proc = train_cli(["--resume", str(run), *RESUME], timeout=840)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    config = (run / "config.yaml").read_text()
    assert "backend: megatron" in config
    train = [r for r in metric_rows(run) if r["step"] > 1]  # the RL steps on megatron
    assert len(train) == 30
    rewards = [r["reward/mean"] for r in train]
    assert_held_out_rise(run, train, " on megatron")
    assert all(r["rollout/failed"] == 0 for r in train)
    assert all(r["weights/tensors_checked"] > 0 for r in train)  # every push verified tensor by tensor
    assert max(r["weights/version"] for r in train) > train[0]["weights/version"]
    assert all(math.isfinite(r["train/grad_norm"]) and r["train/tokens"] > 0 for r in train)
    print("megatron rewards:", json.dumps([round(x, 3) for x in rewards]))

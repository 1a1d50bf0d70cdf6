"""The co-trained speculative draft on tiny-terminal (``engines.0.options.speculative.train``): from the
SFT weights of the shared ``warm_run``, a small draft (a ``tiny:`` spec: it takes the policy's
vocabulary) starts at chance and is trained every step on what the policy sampled; the engine's
acceptance length rises, every push carries the draft and is checked equal, the draft's training
is its own slice of the step time, and a resumed run continues the draft where its checkpoint left
it."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from miles_engine.cli.main import cli
from tests.run.fleet_helpers import assert_accounted
from tests.run.learning import rl_from_sft_weights

STEPS = 12
EPOCHS = 4
DRAFT = [
    "engines.0.options.speculative.method=draft",
    "engines.0.options.speculative.draft_model=tiny:qwen3,hidden_size=64,num_hidden_layers=1,intermediate_size=128",
    "engines.0.options.speculative.num_tokens=3",
    "engines.0.options.speculative.train=true",
    "engines.0.options.speculative.train_lr=0.003",
    f"engines.0.options.speculative.train_epochs={EPOCHS}",
    "weights.check_update_equal=true",
    f"run.checkpoint_every={STEPS}",
]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_co_trained_draft_is_accepted_more_as_it_trains(warm_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "draft"
    train = rl_from_sft_weights(warm_run, run, STEPS, *DRAFT)
    acceptance = [r["engine/spec_acceptance_length"] for r in train]
    early, late = statistics.mean(acceptance[:3]), statistics.mean(acceptance[-3:])
    assert late > early + 0.3, f"acceptance did not rise: {[round(a, 2) for a in acceptance]}"
    losses = [r["draft/loss"] for r in train]
    assert statistics.mean(losses[-3:]) < statistics.mean(losses[:3]), losses
    assert all(r["time/train_draft"] > 0 and r["draft/tokens"] > 0 for r in train)
    assert [r["draft/steps"] for r in train] == [EPOCHS * (i + 1) for i in range(STEPS)]
    # every push carried the draft's tensors and each was read back equal
    assert all(r["weights/tensors_checked"] >= r["weights/tensors"] > 0 for r in train)
    assert all(r["rollout/failed"] == 0 for r in train)
    assert_accounted(run, train)
    state = torch.load(run / "checkpoints" / f"step_{STEPS:08d}" / "trainer.pt", weights_only=False)
    assert state["draft"]["steps"] == EPOCHS * STEPS

    # resumed: the draft continues from its checkpoint (its optimizer steps go on from there)
    result = CliRunner().invoke(cli, ["train", "--resume", str(run), f"run.steps={STEPS + 1}", "run.max_minutes=null",
                                      "metrics.progress=false"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r["kind"] == "train"][-1]
    assert last["step"] == STEPS + 1 and last["draft/steps"] == EPOCHS * (STEPS + 1)
    assert last["engine/spec_acceptance_length"] > early

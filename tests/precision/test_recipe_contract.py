"""The contract wired through a real (shortened) tiny-terminal run: FP8 serving with every push
checked byte for byte against the trainer's weights as the engines must hold them; QAT in MXFP8; and
a run whose train-rollout log-prob gap exceeds precision.max_logprob_gap stops naming a tensor class."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from miles_engine.config.recipe import load_recipe
from miles_engine.hub import default_hub
from miles_engine.precision.config import PrecisionGapError
from miles_engine.precision.diagnose import class_gaps, tensor_class
from miles_engine.run.driver import run_recipe
from miles_engine.trainer.torch_trainer import TorchTrainer
from tests.trainer.helpers import TINY

SHORT = ["sft.enabled=false", "tokenizer.corpus_demos=300", "rollout.mode=sync", "placement.trainer=in_process",
         "rollout.group_size=2", "rollout.groups_per_step=2", "rollout.max_inflight=4", "buffer.capacity_groups=4",
         "run.steps=2", "metrics.progress=false"]


def _run(tmp_path: Path, *overrides: str) -> list[dict]:
    cfg = load_recipe("tiny-terminal", [*SHORT, *overrides, f"run.out_dir={tmp_path}"], hub=default_hub())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    asyncio.run(run_recipe(cfg, run_dir, hub=default_hub()))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", [["precision.rollout=fp8", "precision.kv_cache=fp8"],
                                       ["precision.train=mxfp8", "precision.rollout=mxfp8"]])
def test_a_quantised_run_has_every_push_checked_against_the_format(tmp_path: Path, precision: list[str]) -> None:
    train = _run(tmp_path, *precision, "weights.check_update_equal=true")
    assert len(train) == 2
    assert all(r["weights/tensors_checked"] > 0 for r in train)
    assert all(r["tis/numerics_tokens"] > 0 and r["precision/logprob_gap_mean"] == r["tis/numerics_abs_diff"] and
               r["precision/logprob_gap_max"] >= r["precision/logprob_gap_mean"] > 0 and
               r["precision/ratio_spread"] >= 0 for r in train)


@pytest.mark.timeout(300)
def test_a_gap_above_the_bound_stops_the_run_naming_a_tensor_class(tmp_path: Path) -> None:
    with pytest.raises(PrecisionGapError, match=r"step 1: .* above precision\.max_logprob_gap=1e-09; quantising "
                                                r"layers\.\S+ alone moves .* precision\.exceptions"):
        _run(tmp_path, "precision.rollout=int4", "precision.max_logprob_gap=1e-9")


def test_class_gaps_name_every_class_and_leave_the_model_as_it_was() -> None:
    trainer = TorchTrainer(TINY, {"weight_format": "nvfp4"})
    try:
        before = {n: t.clone() for n, t in trainer.policy.state_dict().items()}
        ids = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(0)).tolist()
        gaps = class_gaps(trainer.policy, [(ids, [0] * 10 + [1] * 30)], "nvfp4")
        assert set(gaps) == {"layers.self_attn.q_proj", "layers.self_attn.k_proj", "layers.self_attn.v_proj",
                             "layers.self_attn.o_proj", "layers.mlp.gate_proj", "layers.mlp.up_proj",
                             "layers.mlp.down_proj"}
        assert all(g > 0 for g in gaps.values()) and list(gaps.values()) == sorted(gaps.values(), reverse=True)
        after = trainer.policy.state_dict()
        assert all(torch.equal(before[n], after[n]) for n in before)
        assert all(m.qat_active for m in trainer.policy.modules() if hasattr(m, "qat_name"))
    finally:
        trainer.close()
    assert tensor_class("model.layers.3.mlp.experts.7.up_proj.weight") == "layers.mlp.experts.up_proj"


def test_the_bound_needs_the_trainers_own_log_probs() -> None:
    with pytest.raises(Exception, match="max_logprob_gap .* needs trainer.algorithm.old_logprobs=recompute"):
        load_recipe("tiny-terminal", ["precision.rollout=fp8", "precision.max_logprob_gap=0.1",
                                      "trainer.algorithm.old_logprobs=rollout", "trainer.mismatch.mode=none"],
                    hub=default_hub())


@pytest.mark.timeout(300)
def test_resume_keeps_the_format(tmp_path: Path) -> None:
    _run(tmp_path, "precision.rollout=fp8", "run.checkpoint_every=1")
    run_dir = tmp_path / "run"
    cfg = load_recipe(str(run_dir / "config.yaml"), ["run.steps=3"], hub=default_hub())
    assert cfg.precision.rollout == "fp8"
    formats: list[set] = []

    def started(run) -> None:
        engines = run.parts.engines
        for engine in getattr(engines, "engines", None) or [engines]:
            formats.append({m.format for m in engine.weight_metadata()})

    assert asyncio.run(run_recipe(cfg, run_dir, hub=default_hub(), resume=True, on_start=started)) == 3
    assert formats and all(f == {"fp8", None} for f in formats)

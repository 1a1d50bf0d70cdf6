"""Per-trajectory rows a train step reports for the run's trajectory record: the advantage each row
trained with, and the trainer's own log-probs for the rows asked for (fused or not: the same)."""

from __future__ import annotations

import pytest
import torch

from miles_engine.trainer import TorchTrainer
from miles_engine.trainer.advantages import grpo_advantages
from miles_engine.trainer.step_rows import ROWS_KEY

from .helpers import TINY, random_groups

BASE = {"optimizer": {"lr": 1e-3}, "mismatch": {"mode": "tis"}}
WANTED = {("g0", 1), ("g1", 3)}


def _groups() -> list:
    groups = random_groups(2, 4, seed=5)
    for g in groups:
        for t in g.trajectories:
            t.group_id = g.group_id  # as the scheduler sets it
    return groups


def _rows(cfg: dict) -> tuple[dict, dict]:
    torch.manual_seed(0)
    groups = _groups()
    trainer = TorchTrainer(TINY, cfg)
    fuse = cfg.get("algorithm", {}).get("fuse_old_logprobs")
    assert fuse is None or trainer.config.fuses_old_logprobs == fuse  # the case named is the case run
    try:
        metrics = trainer.train_step(groups, record=WANTED)
    finally:
        trainer.close()
    return metrics.pop(ROWS_KEY), {(g.group_id, t.index): t for g in groups for t in g.trajectories}


@pytest.mark.parametrize("fuse", [True, False])
def test_rows_hold_the_trainers_advantages_and_log_probs_of_the_rows_asked_for(fuse: bool) -> None:
    rows, trajs = _rows({**BASE, "algorithm": {"fuse_old_logprobs": fuse}})
    assert set(rows) == set(trajs)
    keys = list(trajs)
    want = grpo_advantages(torch.tensor([trajs[k].reward for k in keys]),
                           torch.tensor([int(k[0][1:]) for k in keys]))
    assert [rows[k]["advantage"] for k in keys] == pytest.approx(want.tolist(), abs=1e-6)
    assert {k for k, r in rows.items() if "trainer_logprobs" in r} == WANTED
    for k in WANTED:
        logps, t = rows[k]["trainer_logprobs"], trajs[k]
        assert len(logps) == len(t.token_ids)
        assert all(x < 0 for x, m in zip(logps, t.loss_mask) if m)


def test_fused_and_separate_old_passes_report_the_same_log_probs() -> None:
    fused, _ = _rows({**BASE, "algorithm": {"fuse_old_logprobs": True}})
    separate, trajs = _rows({**BASE, "algorithm": {"fuse_old_logprobs": False}})
    for k in WANTED:
        mask = trajs[k].loss_mask
        a = [x for x, m in zip(fused[k]["trainer_logprobs"], mask) if m]
        b = [x for x, m in zip(separate[k]["trainer_logprobs"], mask) if m]
        assert a == pytest.approx(b, abs=1e-5)


def test_rollout_old_log_probs_are_not_the_trainers() -> None:
    rows, _ = _rows({"optimizer": {"lr": 1e-3}, "mismatch": {"mode": "none"},
                     "algorithm": {"old_logprobs": "rollout"}})
    assert all("trainer_logprobs" not in r for r in rows.values())


@pytest.mark.parametrize("std", [True, False])
def test_the_drivers_advantages_for_ranks_elsewhere_are_the_trainers(std: bool) -> None:
    from miles_engine.run.record_advantages import driver_advantages
    from miles_engine.trainer import TrainerConfig

    cfg = {**BASE, "algorithm": {"grpo_std_normalization": std}}
    rows, trajs = _rows(cfg)
    groups = _groups()
    here = driver_advantages(groups, TrainerConfig.model_validate(cfg).algorithm)
    assert here.keys() == rows.keys()
    assert [here[k] for k in trajs] == pytest.approx([rows[k]["advantage"] for k in trajs], abs=1e-6)
    whitened = TrainerConfig.model_validate({**cfg, "algorithm": {"normalize_advantages": True}}).algorithm
    assert driver_advantages(groups, whitened) == {}  # batch-wide statistics: only the trainer has them


@pytest.mark.timeout(240)
def test_a_trainer_in_its_own_process_sends_its_rows_back_through_the_step_result() -> None:
    from miles_engine.trainer import FSDPTrainer

    here, trajs = _rows(BASE)
    with FSDPTrainer(TINY, BASE, world_size=1) as remote:  # placement.trainer=subprocess
        metrics = remote.train_step(_groups(), record=WANTED)
    there = metrics.pop(ROWS_KEY)
    assert there.keys() == here.keys() and all(isinstance(v, float) for v in metrics.values())
    assert [there[k]["advantage"] for k in trajs] == pytest.approx([here[k]["advantage"] for k in trajs], abs=1e-6)
    for k in WANTED:
        assert there[k]["trainer_logprobs"] == pytest.approx(here[k]["trainer_logprobs"], abs=1e-5)

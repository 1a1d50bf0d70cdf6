"""FSDP2 on 2 gloo ranks behind the driver-side proxy gives what one process gives."""

from __future__ import annotations

import operator

import pytest

from miles_engine.trainer import FSDPTrainer, TorchTrainer, TrainerBackend, TrainerError, build_trainer
from miles_engine.trainer.distributed import rank_info

from .helpers import MOE, TIMING, TINY, max_diff, params, prompt_groups, random_groups

pytestmark = pytest.mark.timeout(240)


def _same_metrics(a: dict[str, float], b: dict[str, float]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k not in TIMING:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), k


def test_two_ranks_match_one_process_grpo_sft_checkpoint() -> None:
    cfg = {"optimizer": {"lr": 1e-3}, "mismatch": {"mode": "tis"}, "max_tokens_per_micro_batch": 40,
           "kl": {"reference": True, "coef": 0.05},
           "lr_schedule": {"kind": "linear", "warmup_steps": 1, "total_steps": 10}}
    single = TorchTrainer(TINY, cfg)
    groups = random_groups(3, 4, seed=2, gaps=True)  # 3 groups on 2 ranks: uneven micro-batch counts
    with build_trainer(TINY, {**cfg, "parallel": {"world_size": 2}}) as multi:
        assert isinstance(multi, FSDPTrainer) and isinstance(multi, TrainerBackend)
        assert multi.call(rank_info) == {"rank": 0, "world_size": 2, "device": "cpu", "weight_version": 0}
        assert max_diff(params(single), params(multi)) == 0  # same seeded init on every rank

        _same_metrics(single.train_step(groups), multi.train_step(groups))
        assert max_diff(params(single), params(multi)) < 2e-5
        _same_metrics(single.train_step(groups[:1]), multi.train_step(groups[:1]))  # rank 1 gets nothing
        rows = [(t.token_ids, t.loss_mask) for g in groups for t in g.trajectories][:5]
        _same_metrics(single.sft_step(rows), multi.sft_step(rows))
        assert multi.weight_version == single.weight_version == 3

        state = multi.state_dict()  # full, gathered on rank 0: loads into one process and back
        ref = single.state_dict()
        assert state["model"].keys() == ref["model"].keys() and state["scheduler"] == ref["scheduler"]
        assert max_diff(state["model"], ref["model"]) < 5e-5
        assert state["optimizer"]["state"].keys() == ref["optimizer"]["state"].keys()
        multi.load_state_dict(ref)
        assert max_diff(params(single), params(multi)) == 0
        _same_metrics(single.train_step(groups), multi.train_step(groups))

        with pytest.raises(TrainerError, match="rank 0 failed during call") as err:
            multi.call(operator.truediv, 0)  # trainer / 0 raises inside every rank
        assert "TypeError" in str(err.value)
        with pytest.raises(TrainerError, match="closed"):
            multi.train_step(groups)


def test_quantisation_aware_training_on_two_ranks_matches_one_process() -> None:
    """FSDP2 unshards a block's weights for its forward, so each rank fake-quantises the whole weight,
    exactly as one process does: the same QAT step (and not the plain one)."""
    cfg = {"optimizer": {"lr": 1e-3}, "max_tokens_per_micro_batch": 40, "weight_format": "mxfp8",
           "weight_exceptions": ["model.layers.1.mlp.*"]}
    single, plain = TorchTrainer(TINY, cfg), TorchTrainer(TINY, {**cfg, "weight_format": "full"})
    groups = random_groups(3, 4, seed=2, gaps=True)
    with FSDPTrainer(TINY, cfg, world_size=2) as multi:
        _same_metrics(single.train_step(groups), multi.train_step(groups))
        plain.train_step(groups)
        assert max_diff(params(single), params(multi)) < 2e-5
        assert max_diff(params(single), params(plain)) > 1e-4  # the quantisation was in effect


def test_two_ranks_match_one_process_ppo_minibatches_moe_replay() -> None:
    cfg = {"algorithm": {"advantage_estimator": "ppo", "normalize_advantages": True, "routing_replay": True},
           "minibatches": 2, "ppo_epochs": 2, "optimizer": {"lr": 1e-3}, "max_tokens_per_micro_batch": 30}
    single = TorchTrainer(MOE, cfg)
    groups = random_groups(3, 3, seed=4, routed=True)
    with FSDPTrainer(MOE, cfg, world_size=2) as multi:
        metrics = multi.train_step(groups)
        assert metrics["r3/replayed_fraction"] == 1.0
        _same_metrics(single.train_step(groups), metrics)
        assert multi.weight_version == 4
        assert max_diff(params(single), params(multi)) < 5e-5


def test_two_ranks_fused_shared_prefix_match_one_process_without_either() -> None:
    """Ranks take the old log-probs from the update's forward and run every micro-batch (and
    every dummy) with the two-pass shared-prefix forward; one process does neither."""
    cfg = {"optimizer": {"lr": 1e-3, "eps": 1e-3}, "mismatch": {"mode": "tis", "low": 0.8, "high": 1.2},
           "max_tokens_per_micro_batch": 90, "kl": {"reference": True, "coef": 0.05}, "entropy_coef": 0.01}
    single = TorchTrainer(TINY, {**cfg, "algorithm": {"fuse_old_logprobs": False}, "shared_prefix": False})
    groups = prompt_groups([20, 26, 18], 4, seed=8, logp=-5.45, gaps=True)  # uneven micro-batch counts
    with FSDPTrainer(TINY, cfg, world_size=2) as multi:
        assert multi.call(operator.attrgetter("prefix_mode")) == "always"
        assert multi.call(operator.attrgetter("ref_prefix_mode")) == "always"
        metrics = multi.train_step(groups)
        assert 0 < metrics["tis/clipfrac"] < 1
        _same_metrics(single.train_step(groups), metrics)
        assert max_diff(params(single), params(multi)) < 1e-6
        _same_metrics(single.train_step(groups[:1]), multi.train_step(groups[:1]))  # rank 1: dummies only
        rows = [(t.token_ids, t.loss_mask) for g in groups for t in g.trajectories][:6]
        _same_metrics(single.sft_step(rows), multi.sft_step(rows))
        assert max_diff(params(single), params(multi)) < 2e-5


def test_a_rank_that_cannot_start_fails_the_trainer_with_its_traceback() -> None:
    with pytest.raises(TrainerError, match="failed during start") as err:
        FSDPTrainer("tiny:nosuchmodel", world_size=1)
    assert "unknown tiny model" in str(err.value)

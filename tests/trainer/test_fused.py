"""Fused old log-probs: taking them from the update's own forward gives the step the separate
no-grad pass gives (loss, gradients, parameters, mismatch metrics), and is used only where
nothing before the update needs them."""

from __future__ import annotations

import pytest

from miles_engine.trainer import TorchTrainer, TrainerConfig

from .helpers import (
    TIMING,
    TINY,
    grads_of_one_step,
    max_diff,
    max_rel_diff,
    params,
    prompt_groups,
    random_groups,
)

BASE = {"optimizer": {"lr": 1e-3}, "grad_clip": None, "max_tokens_per_micro_batch": 60,
        "mismatch": {"mode": "tis", "low": 0.8, "high": 1.2}}


@pytest.mark.parametrize("cfg", [
    BASE,
    {**BASE, "mismatch": {"mode": "clip_or_pop", "low": 0.8, "high": 1.2}, "shared_prefix": False},
    {**BASE, "algorithm": {"advantage_estimator": "gspo"}, "entropy_coef": 0.01,
     "kl": {"reference": True, "coef": 0.05}, "loss_aggregation": "seq_mean_token_sum"},
    {**BASE, "algorithm": {"advantage_estimator": "reinforce_pp"}, "mismatch": {}, "opd": {"coef": 0.5},
     "clip": {"dual_clip_c": 3.0}},
])
def test_fused_old_logprobs_give_the_same_step(cfg: dict) -> None:
    groups = prompt_groups([20, 17, 25], 4, seed=7, logp=-5.45, gaps=True)  # rollout near the policy's
    if cfg.get("opd"):
        for t in (t for g in groups for t in g.trajectories):
            t.teacher_logprobs = [-4.0 if m else 0.0 for m in t.loss_mask]
    fused, unfused = TorchTrainer(TINY, cfg), TorchTrainer(TINY, {**cfg, "algorithm": {
        **cfg.get("algorithm", {}), "fuse_old_logprobs": False}})
    assert fused.config.fuses_old_logprobs and not unfused.config.fuses_old_logprobs
    m_f, g_f = grads_of_one_step(fused, groups)
    m_u, g_u = grads_of_one_step(unfused, groups)
    assert m_f.keys() == m_u.keys()
    for k in m_f.keys() - set(TIMING):
        assert m_f[k] == pytest.approx(m_u[k], rel=1e-6, abs=1e-7), k
    if cfg["mismatch"]:
        assert 0 < m_f["tis/clipfrac"] < 1 and m_f["tis/ratio_min"] < 0.8 and m_f["tis/ratio_max"] > 1.2
    assert m_f["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert max_rel_diff(g_u, g_f) < 1e-6
    assert max_diff(params(fused), params(unfused)) < 1e-6


def test_the_fused_step_skips_the_old_logprob_pass() -> None:
    groups = random_groups(2, 4, seed=2)
    counts = {}
    for fuse in (True, False):
        tr = TorchTrainer(TINY, {"algorithm": {"fuse_old_logprobs": fuse}, "mismatch": {"mode": "tis"}})
        calls: list[int] = []
        tr.policy.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        assert "tis/ratio_mean" in tr.train_step(groups)
        counts[fuse] = len(calls)
    assert counts == {True: 1, False: 2}  # one micro-batch: the update's forward (+ the old pass)


@pytest.mark.parametrize("cfg", [
    {"algorithm": {"fuse_old_logprobs": False}},
    {"algorithm": {"old_logprobs": "rollout"}},
    {"algorithm": {"advantage_estimator": "ppo"}},
    {"algorithm": {"advantage_estimator": "reinforce_pp"}, "kl": {"reference": True, "placement": "reward"}},
    {"opd": {"beta": 0.1}},
    {"opd": {"coef": 0.1, "candidates": "teacher_topk"}},
    {"ppo_epochs": 2},
    {"minibatches": 2},
])
def test_old_logprobs_are_not_fused_where_the_preparation_needs_them(cfg: dict) -> None:
    assert not TrainerConfig.load(cfg).fuses_old_logprobs
    assert TrainerConfig.load({"kl": {"reference": True, "coef": 0.1}, "opd": {"coef": 0.1}}).fuses_old_logprobs

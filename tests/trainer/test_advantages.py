"""Advantage estimators and the OPD term against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from miles_engine.trainer import advantages as A

T = torch.tensor


def test_grpo_group_mean_and_unbiased_std() -> None:
    rewards = T([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0])
    groups = T([0, 0, 0, 0, 1, 1, 1])
    adv = A.grpo_advantages(rewards, groups, std_normalization=True, eps=0.0)
    # group 0: mean 0.5, std sqrt(1/3); group 1: mean 3, std sqrt(3)
    s0, s1 = 0.5 / math.sqrt(1 / 3), 1 / math.sqrt(3)
    assert torch.allclose(adv, T([s0, -s0, -s0, s0, -s1, -s1, 2 * s1]), atol=1e-6)
    plain = A.grpo_advantages(rewards, groups, std_normalization=False)
    assert torch.allclose(plain, T([0.5, -0.5, -0.5, 0.5, -1.0, -1.0, 2.0]))


def test_grpo_eps_and_identical_rewards() -> None:
    adv = A.grpo_advantages(T([1.0, 1.0]), T([0, 0]), eps=1e-6)
    assert torch.equal(adv, T([0.0, 0.0]))  # no NaN when the std is 0
    adv = A.grpo_advantages(T([0.0, 1.0]), T([0, 0]), eps=0.5)
    std = math.sqrt(0.5)
    assert torch.allclose(adv, T([-0.5 / (std + 0.5), 0.5 / (std + 0.5)]))


def test_grpo_std_normalisation_refuses_a_group_of_one() -> None:
    with pytest.raises(ValueError, match="grpo_std_normalization"):
        A.grpo_advantages(T([1.0]), T([0]), std_normalization=True)
    assert A.grpo_advantages(T([1.0]), T([0]), std_normalization=False).tolist() == [0.0]


def test_broadcast_and_last_token() -> None:
    mask = T([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    assert A.broadcast_to_tokens(T([2.0, -1.0, 3.0]), mask).tolist() == [[0, 2, 2, 0], [0, 0, -1, -1], [0, 0, 0, 0]]
    assert A.last_token_mask(mask).tolist() == [[0, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0]]


def test_gae_over_sampled_tokens_skips_env_gaps() -> None:
    mask = T([[0.0, 1.0, 1.0, 0.0, 1.0]])  # index 3 is an environment token
    values = T([[0.0, 0.5, 0.2, 9.0, 0.4]])
    rewards = A.token_rewards(T([1.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 1]]
    adv, ret = A.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # t4: 1 - 0.4 = 0.6; t2: 0.9*0.4 - 0.2 + 0.72*0.6 = 0.592; t1: 0.9*0.2 - 0.5 + 0.72*0.592 = 0.10624
    assert torch.allclose(adv, T([[0.0, 0.10624, 0.592, 0.0, 0.6]]), atol=1e-6)
    assert torch.allclose(ret, T([[0.0, 0.60624, 0.792, 0.0, 1.0]]), atol=1e-6)


def test_discounted_returns_with_kl_penalty_in_reward() -> None:
    mask = T([[0.0, 1.0, 1.0]])
    kl = T([[0.0, 0.1, 0.2]])
    r = A.token_rewards(T([1.0]), mask, kl, kl_coef=0.5)
    assert torch.allclose(r, T([[0.0, -0.05, 0.9]]))
    assert torch.allclose(A.discounted_returns(r, mask, gamma=0.5), T([[0.0, 0.4, 0.9]]))


def test_reinforce_pp_whitens_returns_over_the_batch() -> None:
    mask = T([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    adv = A.reinforce_pp_advantages(T([1.0, 0.0]), mask, gamma=1.0)
    # returns on tokens: 1, 1, 0 -> mean 2/3, population std sqrt(2/9)
    hi, lo = (1 / 3) / math.sqrt(2 / 9), (-2 / 3) / math.sqrt(2 / 9)
    assert torch.allclose(adv, T([[0.0, hi, hi], [0.0, 0.0, lo]]), atol=1e-5)
    # global moments (as from an all-reduce) are used when given
    moments = A.masked_moments(T([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), mask) * 2
    adv2 = A.reinforce_pp_advantages(T([1.0, 0.0]), mask, moments_fn=lambda m: moments)
    assert torch.allclose(adv2, adv, atol=1e-5)


def test_reinforce_pp_baseline_is_group_mean() -> None:
    assert A.group_mean_baseline(T([1.0, 0.0, 3.0]), T([0, 0, 1])).tolist() == [0.5, -0.5, 0.0]


def test_opd_term() -> None:
    mask = T([[0.0, 1.0, 1.0]])
    adv = T([[0.0, 1.0, 1.0]])
    out = A.opd_adjust(adv, T([[0.0, -1.0, -2.0]]), T([[0.0, -1.5, -1.0]]), mask, beta=0.5)
    # A - 0.5 * (student - teacher): 1 - 0.5*0.5 = 0.75; 1 - 0.5*(-1) = 1.5
    assert torch.allclose(out, T([[0.0, 0.75, 1.5]]))
    assert A.opd_adjust(adv, adv, adv, mask, 0.0) is adv


def test_whiten_is_masked() -> None:
    x = T([[100.0, 1.0, 3.0]])
    out = A.whiten(x, T([[0.0, 1.0, 1.0]]), eps=0.0)
    assert torch.allclose(out, T([[0.0, -1.0, 1.0]]))

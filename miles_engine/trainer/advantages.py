"""Advantage estimators: pure functions on padded ``[rows, tokens]`` tensors.

Conventions: ``mask`` is the loss mask (1.0 on sampled tokens), every per-token tensor is
aligned with the token row (index i holds the value for ``token_ids[i]``). Multi-turn rows
have gaps (environment tokens, mask 0): discounting and GAE run over the *sampled* tokens
only, in order, skipping the gaps; the sequence reward sits on the last sampled token.
"""

from __future__ import annotations

import torch
from torch import Tensor


def grpo_advantages(rewards: Tensor, group_index: Tensor, *, std_normalization: bool = True,
                    eps: float = 1e-6) -> Tensor:
    """Per-row GRPO advantage: ``r - mean(group)``, divided by ``std(group) + eps`` (unbiased std)
    when ``std_normalization``. ``group_index[i]`` names row i's group. Returns ``[rows]``."""
    rewards = rewards.to(torch.float64)
    out = torch.empty_like(rewards)
    for g in torch.unique(group_index):
        sel = group_index == g
        r = rewards[sel]
        centred = r - r.mean()
        if std_normalization:
            if r.numel() < 2:
                raise ValueError("GRPO std normalisation needs groups of at least 2 trajectories "
                                 "(algorithm.grpo_std_normalization=true with a group of 1)")
            centred = centred / (r.std(unbiased=True) + eps)
        out[sel] = centred
    return out.to(torch.float32)


def group_mean_baseline(rewards: Tensor, group_index: Tensor) -> Tensor:
    """``r - mean(group)`` per row (REINFORCE++ with baseline)."""
    return grpo_advantages(rewards, group_index, std_normalization=False)


def broadcast_to_tokens(per_row: Tensor, mask: Tensor) -> Tensor:
    """``[rows]`` -> ``[rows, tokens]``: the row value on every sampled token, 0 elsewhere."""
    return per_row.to(mask.dtype)[:, None] * mask


def last_token_mask(mask: Tensor) -> Tensor:
    """1.0 at the last sampled token of each row (rows without sampled tokens: all 0)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros_like(mask)
    has = last >= 0
    out[has.nonzero(as_tuple=True)[0], last[has]] = 1.0
    return out


def token_rewards(rewards: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """Per-token reward: the sequence reward on the last sampled token, minus ``kl_coef * kl``
    on every sampled token when ``kl`` is given (KL penalty in the reward)."""
    out = last_token_mask(mask) * rewards.to(mask.dtype)[:, None]
    if kl is not None and kl_coef:
        out = out - kl_coef * kl * mask
    return out


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``G_t = r_t + gamma * G_next`` over the sampled tokens of each row (gaps skipped)."""
    ret = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in range(rewards.shape[1] - 1, -1, -1):
        m = mask[:, t] > 0
        running = torch.where(m, rewards[:, t] + gamma * running, running)
        ret[:, t] = torch.where(m, running, torch.zeros_like(running))
    return ret


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the sampled tokens of each row.

    ``delta_t = r_t + gamma * V_next - V_t`` (``V`` after the last sampled token is 0),
    ``A_t = delta_t + gamma * lam * A_next``. Returns ``(advantages, returns = A + V)``, 0 off-mask.
    """
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    running = torch.zeros_like(next_value)
    for t in range(rewards.shape[1] - 1, -1, -1):
        m = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        new = delta + gamma * lam * running
        running = torch.where(m, new, running)
        next_value = torch.where(m, values[:, t], next_value)
        adv[:, t] = torch.where(m, running, torch.zeros_like(running))
    return adv, (adv + values) * mask


def masked_moments(x: Tensor, mask: Tensor) -> Tensor:
    """``[sum, sum of squares, count]`` of ``x`` over the mask (float64; all-reduce these across ranks)."""
    x64, m64 = x.to(torch.float64), mask.to(torch.float64)
    return torch.stack([(x64 * m64).sum(), (x64 * x64 * m64).sum(), m64.sum()])


def whiten(x: Tensor, mask: Tensor, moments: Tensor | None = None, eps: float = 1e-8,
           shift_mean: bool = True) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over masked entries (population variance); ``moments`` from
    :func:`masked_moments` (summed over ranks) makes the statistics global."""
    s, ss, n = (masked_moments(x, mask) if moments is None else moments).tolist()
    if n <= 0:
        return x * 0
    mean = s / n
    var = max(ss / n - mean * mean, 0.0)
    centred = x - mean if shift_mean else x
    return centred / (var + eps) ** 0.5 * mask


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, *, gamma: float = 1.0, kl: Tensor | None = None,
                            kl_coef: float = 0.0, moments_fn=None) -> Tensor:
    """REINFORCE++: discounted returns of the per-token reward (sequence reward on the last
    sampled token, ``-kl_coef * kl`` per token), whitened over the whole batch. ``moments_fn``
    turns local :func:`masked_moments` into global ones (e.g. an all-reduce)."""
    returns = discounted_returns(token_rewards(rewards, mask, kl, kl_coef), mask, gamma)
    moments = masked_moments(returns, mask)
    if moments_fn is not None:
        moments = moments_fn(moments)
    return whiten(returns, mask, moments)


def opd_adjust(advantages: Tensor, student_logp: Tensor, teacher_logp: Tensor, mask: Tensor, beta: float) -> Tensor:
    """On-policy distillation: ``A <- A - beta * (logp_student_old - logp_teacher)`` on sampled tokens."""
    if not beta:
        return advantages
    return advantages - beta * (student_logp - teacher_logp) * mask

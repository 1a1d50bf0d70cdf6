"""Loss terms: pure functions on padded ``[rows, tokens]`` tensors (mask = loss mask).

Every term returns a per-token tensor; :func:`aggregate` reduces it. Pass the step's global
``num_tokens`` / ``num_seqs`` (over every micro-batch and rank) so that summing the
micro-batch losses gives exactly the full-batch loss and gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def aggregate(x: Tensor, mask: Tensor, mode: str, *, num_tokens: float | None = None,
              num_seqs: float | None = None) -> Tensor:
    """Reduce per-token ``x`` to a scalar.

    - ``token_mean``: ``sum(x * m) / num_tokens`` (default: ``sum(m)``)
    - ``seq_mean_token_mean``: per row ``sum(x * m) / sum(m)``, summed, ``/ num_seqs``
    - ``seq_mean_token_sum``: per row ``sum(x * m)``, summed, ``/ num_seqs``
    ``num_seqs`` defaults to the rows with at least one masked token.
    """
    xm = x * mask
    if mode == "token_mean":
        denom = float(num_tokens) if num_tokens is not None else mask.sum().item()
        return xm.sum() / max(denom, 1.0)
    per_row_tokens = mask.sum(dim=1)
    per_row = xm.sum(dim=1)
    if mode == "seq_mean_token_mean":
        per_row = per_row / per_row_tokens.clamp(min=1.0)
    elif mode != "seq_mean_token_sum":
        raise ValueError(f"unknown loss aggregation {mode!r}; allowed: {', '.join(AGGREGATIONS)}")
    denom = float(num_seqs) if num_seqs is not None else (per_row_tokens > 0).sum().item()
    return per_row.sum() / max(denom, 1.0)


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO: per row, the mean token log-ratio ``mean_t(logp - old)`` broadcast to every token
    (gradients flow to every token of the row)."""
    per_row = ((logp - old_logp) * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    return per_row[:, None].expand_as(logp)


@dataclass
class PolicyLossOut:
    loss: Tensor  # per token
    ratio: Tensor  # per token (detached)
    clipped: Tensor  # 1.0 where the clipped branch won
    dual_clipped: Tensor  # 1.0 where the dual-clip cap applied


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, eps_low: float = 0.2,
                eps_high: float | None = None, dual_clip_c: float | None = None,
                sequence_level: bool = False) -> PolicyLossOut:
    """Clipped surrogate ``max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))`` per token,
    with ``r = exp(logp - old_logp)`` (GSPO: ``r = exp(mean log-ratio of the row)``). Dual clip:
    for ``A < 0`` the loss is capped at ``-c * A``."""
    eps_high = eps_low if eps_high is None else eps_high
    log_ratio = sequence_log_ratio(logp, old_logp, mask) if sequence_level else logp - old_logp
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1).to(mask.dtype)
    dual = torch.zeros_like(mask)
    if dual_clip_c is not None:
        cap = -advantages * dual_clip_c
        use_cap = (advantages < 0) & (loss > cap)
        loss = torch.where(use_cap, cap, loss)
        dual = use_cap.to(mask.dtype)
    return PolicyLossOut(loss * mask, ratio.detach(), clipped * mask, dual * mask)


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi, ``d = logp - ref_logp``:
    k1 = d; k2 = d^2 / 2; k3 = exp(-d) - 1 + d (unbiased, non-negative)."""
    d = logp - ref_logp
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        d = d.clamp(-20.0, 20.0)
        return torch.exp(-d) - 1.0 + d
    raise ValueError(f"unknown KL estimator {estimator!r}; allowed: k1, k2, k3")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at every position: ``[..., vocab] -> [...]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def token_logprobs(logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-prob of ``token_ids[:, i]`` under the logits of position ``i - 1``; index 0 holds 0.

    ``logits``: ``[rows, tokens, vocab]``, ``token_ids``: ``[rows, tokens]`` -> ``[rows, tokens]``.
    """
    shifted = logits[:, :-1].float()
    if temperature != 1.0:
        shifted = shifted / temperature
    logp = torch.log_softmax(shifted, dim=-1).gather(-1, token_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0))


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip: float | None = None) -> tuple[Tensor, Tensor]:
    """``0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2)`` per token, and the clipped-branch mask."""
    err = (values - returns) ** 2
    if clip is None:
        return 0.5 * err * mask, torch.zeros_like(mask)
    clipped_v = old_values + (values - old_values).clamp(-clip, clip)
    err_c = (clipped_v - returns) ** 2
    return 0.5 * torch.maximum(err, err_c) * mask, (err_c > err).to(mask.dtype) * mask


def sft_loss(logp: Tensor) -> Tensor:
    """Per-token negative log-likelihood (aggregate with the loss mask)."""
    return -logp

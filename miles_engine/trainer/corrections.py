"""Train-rollout mismatch correction per token, and its metrics.

The rollout engine and the trainer compute slightly different log-probs for the same token
(kernels, dtypes, stale weights in async mode). With ``ratio = exp(logp_trainer_old -
logp_rollout)`` on each sampled token, the policy loss is multiplied by a detached weight:

- ``tis`` (truncated importance sampling): ``w = clamp(ratio, low, high)``
- ``clip_or_pop``: ``w = ratio`` inside ``[low, high]``, ``0`` outside (the token is dropped)
- ``none``: ``w = 1`` (metrics are still reported)

Statistics are returned as sums / extrema so they can be reduced across micro-batches and
ranks before :func:`finalize_stats` turns them into metrics.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

MODES = ("none", "tis", "clip_or_pop")
_LOG_CAP = 40.0  # keeps pre-clip ratio statistics finite (e^40 ~ 2e17)

# order of the summed statistics in :func:`mismatch_stats`
SUM_KEYS = ("count", "ratio_sum", "clipped", "abs_ratio_minus_one", "abs_logp_diff", "k3")


def mismatch_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, mode: str = "tis",
                     low: float = 0.0, high: float = 2.0) -> Tensor:
    """Detached per-token weights for the policy loss (1.0 off-mask)."""
    if mode not in MODES:
        raise ValueError(f"unknown mismatch correction {mode!r}; allowed: {', '.join(MODES)}")
    if low > high:
        raise ValueError(f"mismatch.low ({low}) is above mismatch.high ({high})")
    on = mask > 0
    ratio = torch.exp((old_logp - rollout_logp).detach().clamp(-_LOG_CAP, _LOG_CAP))
    if mode == "none":
        w = torch.ones_like(ratio)
    elif mode == "tis":
        w = ratio.clamp(low, high)
    else:
        w = torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))
    return torch.where(on, w, torch.ones_like(w))


def mismatch_stats(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, low: float = 0.0,
                   high: float = 2.0) -> tuple[Tensor, Tensor, Tensor]:
    """``(sums, min_ratio, max_ratio)``; ``sums`` is float64 in :data:`SUM_KEYS` order:
    token count, sum of pre-clip ratios, tokens outside ``[low, high]``, sum of ``|ratio - 1|``,
    sum of ``|logp_rollout - logp_trainer|``, sum of the k3 estimate of KL(rollout || trainer)
    (``exp(d) - 1 - d`` with ``d = logp_trainer - logp_rollout``)."""
    on = mask > 0
    d = (old_logp - rollout_logp).detach().to(torch.float64).clamp(-_LOG_CAP, _LOG_CAP)
    ratio = torch.exp(d)
    sel_ratio = ratio[on]
    sums = torch.stack([
        on.sum().to(torch.float64),
        sel_ratio.sum(),
        ((sel_ratio < low) | (sel_ratio > high)).sum().to(torch.float64),
        (sel_ratio - 1).abs().sum(),
        d[on].abs().sum(),
        (torch.exp(d[on]) - 1 - d[on]).sum(),
    ])
    if sel_ratio.numel():
        return sums, sel_ratio.min(), sel_ratio.max()
    return sums, torch.tensor(float("inf"), dtype=torch.float64), torch.tensor(float("-inf"), dtype=torch.float64)


def finalize_stats(sums: Tensor, min_ratio: Tensor, max_ratio: Tensor, prefix: str = "tis/") -> dict[str, float]:
    """Metrics from (reduced) :func:`mismatch_stats` output."""
    s = dict(zip(SUM_KEYS, sums.tolist()))
    n = s["count"]
    if n <= 0:
        return {}
    return {
        f"{prefix}ratio_mean": s["ratio_sum"] / n,
        f"{prefix}ratio_min": float(min_ratio),
        f"{prefix}ratio_max": float(max_ratio),
        f"{prefix}clipfrac": s["clipped"] / n,
        f"{prefix}abs_ratio_minus_one": s["abs_ratio_minus_one"] / n,
        f"{prefix}logprob_abs_diff": s["abs_logp_diff"] / n,
        f"{prefix}kl_k3": s["k3"] / n,
    }


def reduce_stats(comm: Any, sums: Tensor, min_ratio: Tensor, max_ratio: Tensor,
                 prefix: str = "tis/") -> dict[str, float]:
    """:func:`finalize_stats` of local statistics summed / min'd / max'd over every rank of ``comm``
    (every rank must call this: collectives)."""
    lo, hi = comm.all_min(min_ratio.reshape(1))[0], comm.all_max(max_ratio.reshape(1))[0]
    return finalize_stats(comm.all_sum(sums), lo, hi, prefix)


def version_split_stats(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, versions: Tensor,
                        current: int) -> tuple[Tensor, Tensor]:
    """The gap ``|logp_trainer - logp_rollout|`` apart on tokens the engine sampled with the
    trainer's current weights (``versions == current``: only numerics can differ, exactly 0
    with true on-policy) and on older tokens (staleness on top). ``(sums, maxima)``, float64:
    sums = [current tokens, their |gap| sum, stale tokens, their |gap| sum]; maxima = the
    largest |gap| of each (0 when there is none)."""
    on = mask > 0
    gap = (old_logp - rollout_logp).detach().to(torch.float64).abs()
    cur = on & (versions == current)
    stale = on & ~cur
    zero = torch.zeros((), dtype=torch.float64, device=gap.device)
    sums = torch.stack([cur.sum().to(torch.float64), gap[cur].sum(), stale.sum().to(torch.float64), gap[stale].sum()])
    maxima = torch.stack([gap[cur].max() if bool(cur.any()) else zero, gap[stale].max() if bool(stale.any()) else zero])
    return sums, maxima


def finalize_split(sums: Tensor, maxima: Tensor, prefix: str = "tis/") -> dict[str, float]:
    """Metrics from (reduced) :func:`version_split_stats`: ``numerics_*`` (tokens of the current
    version) and ``stale_*`` (older ones); the mean and max appear when there are such tokens."""
    n_cur, sum_cur, n_stale, sum_stale = sums.tolist()
    max_cur, max_stale = maxima.tolist()
    out = {f"{prefix}numerics_tokens": n_cur, f"{prefix}stale_tokens": n_stale}
    if n_cur > 0:
        out.update({f"{prefix}numerics_abs_diff": sum_cur / n_cur, f"{prefix}numerics_max_abs_diff": max_cur})
    if n_stale > 0:
        out.update({f"{prefix}stale_abs_diff": sum_stale / n_stale, f"{prefix}stale_max_abs_diff": max_stale})
    return out


def reduce_split(comm: Any, sums: Tensor, maxima: Tensor, prefix: str = "tis/") -> dict[str, float]:
    """:func:`finalize_split` over every rank of ``comm`` (a collective)."""
    return finalize_split(comm.all_sum(sums.cpu()), comm.all_max(maxima.cpu()), prefix)


class MismatchAccumulator:
    """Weights and statistics micro-batch by micro-batch, for old log-probs that only exist
    inside the update's forward (fused old log-probs); :meth:`finalize` once at the end."""

    def __init__(self, mode: str, low: float, high: float, current_version: int | None = None) -> None:
        self.mode, self.low, self.high = mode, low, high
        self.current_version = current_version
        self.split_sums = torch.zeros(4, dtype=torch.float64)
        self.split_max = torch.zeros(2, dtype=torch.float64)
        self.sums = torch.zeros(len(SUM_KEYS), dtype=torch.float64)
        self.min_ratio = torch.tensor(float("inf"), dtype=torch.float64)
        self.max_ratio = torch.tensor(float("-inf"), dtype=torch.float64)

    def add(self, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor,
            versions: Tensor | None = None) -> Tensor | None:
        """Record one micro-batch (``versions``: per-token weight versions, for the
        numerics / staleness split); its per-token weights (``None`` for mode ``none``)."""
        if versions is not None and self.current_version is not None:
            s, m = version_split_stats(old_logp, rollout_logp, mask, versions, self.current_version)
            self.split_sums = self.split_sums + s.cpu()
            self.split_max = torch.maximum(self.split_max, m.cpu())
        sums, lo, hi = mismatch_stats(old_logp, rollout_logp, mask, self.low, self.high)
        self.sums = self.sums + sums.cpu()
        self.min_ratio = torch.minimum(self.min_ratio, lo.cpu())
        self.max_ratio = torch.maximum(self.max_ratio, hi.cpu())
        if self.mode == "none":
            return None
        return mismatch_weights(old_logp, rollout_logp, mask, self.mode, self.low, self.high)

    def finalize(self, comm: Any) -> dict[str, float]:
        out = reduce_stats(comm, self.sums, self.min_ratio, self.max_ratio)
        if self.current_version is not None:
            out.update(reduce_split(comm, self.split_sums, self.split_max))
        return out

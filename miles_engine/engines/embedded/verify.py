"""Exact speculative sampling: which proposed tokens the policy keeps, and the token after them.

Per row, the policy's logits at the ``q = m + 1`` fed positions (the last emitted token, then
the ``m`` proposals ``x_1..x_m``) give ``p_j``: the distribution plain decoding would sample
from there — after temperature, top-k, top-p and renormalisation, built by
:func:`~miles_engine.engines.embedded.sampler.filtered_logprobs` exactly as the sampler does.

- greedy rows: ``x_j`` is kept while it equals ``argmax`` of the raw logits; the next token is
  that argmax. Every token is the one plain greedy decoding emits.
- sampled rows (Leviathan et al. 2023, Chen et al. 2023): ``x_j`` drawn from the proposer's
  ``q_j`` is kept with probability ``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection the
  next token is drawn from ``normalize(max(0, p_j - q_j))``, after ``m`` acceptances from
  ``p_{m+1}``. Every emitted token is then distributed exactly as under ``p``. An n-gram
  proposal is a point mass: kept with probability ``p_j(x_j)``, residual ``p_j`` without ``x_j``.

The log-prob reported for every emitted token is ``log p_j(token)`` — the policy's, never the
proposer's. Uniforms come from each request's own generator, a fixed number per step (so a
seeded request is reproducible whatever shares its batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_engine.engines.embedded.sampler import RowParams, filtered_logprobs


@dataclass
class Verdict:
    accepted: list[int]  # proposals kept per row
    tokens: list[list[int]]  # per row: the kept proposals, then one token from the policy
    logprobs: list[list[float]]  # the policy's filtered log-prob of each of those tokens


def verify(logits: torch.Tensor, proposals: list[list[int]], draft_logp: torch.Tensor | None,
           params: list[RowParams], uniforms: torch.Tensor, *, invariant: bool = False) -> Verdict:
    """``logits`` [rows, q, vocab]: the policy at the fed positions (column j predicts the token
    after x_j; column 0 after the last emitted token). ``proposals``: at most ``q - 1`` per row.
    ``draft_logp`` [rows, >= q-1, vocab]: the proposer's filtered log q_j (None: point masses).
    ``uniforms`` [rows, q]: U[0, 1) draws per row — ``q - 1`` acceptance tests, then the last
    one for the policy's own token (ignored for greedy rows)."""
    rows, q, vocab = logits.shape
    k = q - 1
    dev = logits.device
    logp = filtered_logprobs(logits.reshape(rows * q, vocab), [p for p in params for _ in range(q)],
                             invariant=invariant).reshape(rows, q, vocab)
    top = logits.argmax(-1)  # [rows, q]: the greedy choice (as the sampler makes it: raw logits)
    m = torch.tensor([len(p) for p in proposals], device=dev)
    x = torch.tensor([p + [0] * (k - len(p)) for p in proposals], dtype=torch.long, device=dev).reshape(rows, k)
    greedy = torch.tensor([p.temperature == 0.0 for p in params], device=dev)
    p_x = logp[:, :k].gather(2, x[..., None]).squeeze(2)  # log p_j(x_j) [rows, k]
    log_ratio = p_x - draft_logp[:, :k].gather(2, x[..., None]).squeeze(2) if draft_logp is not None else p_x
    u = uniforms.to(dev)
    ok = torch.where(greedy[:, None], x == top[:, :k], u[:, :k] < log_ratio.exp())
    ok &= torch.arange(k, device=dev)[None, :] < m[:, None]
    accepted = ok.long().cumprod(1).sum(1) if k else torch.zeros(rows, dtype=torch.long, device=dev)

    at = accepted  # the column whose distribution gives the next token
    nxt = top.gather(1, at[:, None]).squeeze(1)
    if not bool(greedy.all()):
        hot = (~greedy).nonzero().squeeze(1)
        a = at[hot]
        base = logp[hot, a].exp()  # p at the first rejection (or after the last proposal)
        rejected = a < m[hot]
        if draft_logp is not None:
            q_at = draft_logp[hot, a.clamp(max=max(k - 1, 0))].exp() if k else torch.zeros_like(base)
            residual = (base - q_at).clamp_min(0.0)
        else:
            residual = base.scatter(1, x[hot].gather(1, a.clamp(max=max(k - 1, 0))[:, None]), 0.0) if k else base
        dist = torch.where(rejected[:, None], residual, base)
        empty = dist.sum(-1) <= 0  # p == q to rounding: rejection had probability ~0; fall back to p
        dist = torch.where(empty[:, None], base, dist)
        cdf = torch.cumsum(dist, dim=-1)
        draw = ((1.0 - u[hot, k]) * cdf[:, -1]).to(cdf.dtype)[:, None]
        nxt[hot] = torch.searchsorted(cdf, draw).squeeze(1).clamp_(max=vocab - 1)
    next_lp = logp.gather(1, at[:, None, None].expand(rows, 1, vocab)).squeeze(1).gather(1, nxt[:, None]).squeeze(1)

    acc, nxt_l, next_lp_l, p_x_l = accepted.tolist(), nxt.tolist(), next_lp.tolist(), p_x.tolist()
    tokens = [proposals[r][: acc[r]] + [nxt_l[r]] for r in range(rows)]
    lps = [p_x_l[r][: acc[r]] + [next_lp_l[r]] for r in range(rows)]
    return Verdict(acc, tokens, lps)


def sample_from(logp: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row of ``exp(logp)`` ([rows, vocab]) with ``uniforms`` in [0, 1)."""
    cdf = torch.cumsum(logp.exp(), dim=-1)
    draw = ((1.0 - uniforms.to(cdf.device)) * cdf[:, -1]).to(cdf.dtype)[:, None]
    return torch.searchsorted(cdf, draw).squeeze(1).clamp_(max=logp.shape[-1] - 1)

"""Batched sampling with per-request generators.

Per row, in this order (as SGLang / vLLM): greedy when ``temperature == 0``; otherwise
``logits / temperature`` -> keep the ``top_k`` largest -> keep the smallest set of the
remaining tokens whose renormalised probability reaches ``top_p`` -> renormalise -> draw one
token with the request's own ``torch.Generator`` (so a seeded request samples the same stream
whatever else shares its batch).

The reported log-prob is ``log q(token)`` where ``q`` is exactly that final renormalised
distribution (the one the token was drawn from). For greedy rows it is the log-softmax of the
unscaled logits (``log p(token)`` of the model's own distribution).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from miles_engine.batch_invariant import log_softmax


@dataclass(frozen=True)
class RowParams:
    temperature: float
    top_p: float
    top_k: int  # -1 = off


def filtered_logprobs(logits: torch.Tensor, params: list[RowParams], *, invariant: bool = False) -> torch.Tensor:
    """Log of the distribution each row samples from ([rows, vocab] float32; -inf = excluded).
    Greedy rows get the plain log-softmax. This is also the reference the tests teacher-force.
    ``invariant``: every log-softmax is the batch-invariant one (true on-policy)."""
    logits = logits.float()
    log_softmax = _invariant_log_softmax if invariant else torch.log_softmax
    if all(p.temperature == 0.0 for p in params):
        return log_softmax(logits, dim=-1)
    out = torch.empty_like(logits)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    if greedy:
        g = torch.tensor(greedy, device=logits.device)
        out[g] = log_softmax(logits[g], dim=-1)
    hot = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if not hot:
        return out
    h = torch.tensor(hot, device=logits.device)
    temps = torch.tensor([params[i].temperature for i in hot], device=logits.device, dtype=torch.float32)
    scaled = logits[h] / temps[:, None]
    ks = [params[i].top_k for i in hot]
    ps = [params[i].top_p for i in hot]
    vocab = scaled.shape[-1]
    if all(k <= 0 or k >= vocab for k in ks) and all(p >= 1.0 for p in ps):
        out[h] = log_softmax(scaled, dim=-1)
        return out
    out[h] = _nucleus(scaled, ks, ps, log_softmax=log_softmax)
    return out


def _invariant_log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return log_softmax(x)


def _nucleus(scaled: torch.Tensor, ks: list[int], ps: list[float], candidates: int = 1024,
             log_softmax: Any = torch.log_softmax) -> torch.Tensor:
    """Top-k then top-p over the ``K`` best tokens of each row (``torch.topk``, not a full
    vocabulary sort). Exact: ``K`` covers every finite top-k, and a top-p row whose nucleus
    might reach past ``K`` (the K best hold less than ``top_p`` of the mass) is redone with
    8x the candidates (at most the whole vocabulary)."""
    vocab = scaled.shape[-1]
    need = [k if 0 < k < vocab else (vocab if p >= 1.0 else candidates) for k, p in zip(ks, ps)]
    kmax = min(max(need), vocab)
    vals, order = torch.topk(scaled, kmax, dim=-1)  # sorted, descending
    rank = torch.arange(kmax, device=scaled.device)[None, :]
    kk = torch.tensor([k if 0 < k < vocab else vocab for k in ks], device=scaled.device)[:, None]
    vals = vals.masked_fill(rank >= kk, float("-inf"))
    # normaliser: over the top-k set when top-k is on, else over the whole row
    has_k = torch.tensor([0 < k < vocab for k in ks], device=scaled.device)
    if bool(has_k.all()):
        log_z = torch.logsumexp(vals, dim=-1, keepdim=True)
    else:
        log_z = torch.where(has_k, torch.logsumexp(vals, dim=-1), torch.logsumexp(scaled, dim=-1))[:, None]
    probs = torch.exp(vals - log_z)
    cum = torch.cumsum(probs, dim=-1)
    pp = torch.tensor(ps, device=scaled.device, dtype=torch.float32)[:, None]
    if kmax < vocab:
        short = (~has_k) & (pp[:, 0] < 1.0) & (cum[:, -1] < pp[:, 0])
        if bool(short.any()):
            return _nucleus(scaled, ks, ps, candidates=8 * candidates, log_softmax=log_softmax)
    before = cum - probs  # mass of strictly better tokens
    vals = vals.masked_fill((before >= pp) & (rank > 0), float("-inf"))
    filtered = torch.full_like(scaled, float("-inf")).scatter_(1, order, vals)
    return log_softmax(filtered, dim=-1)


def sample(logits: torch.Tensor, params: list[RowParams],
           generators: list[torch.Generator | None], *, invariant: bool = False) -> tuple[list[int], list[float]]:
    """Draw one token per row; returns (tokens, log-probs under the sampled-from distribution).

    Sampled rows use inverse-CDF sampling with one uniform draw per row from the row's own
    generator (vectorised over rows; a token outside the kept set has zero mass and is
    never chosen)."""
    logp = filtered_logprobs(logits, params, invariant=invariant)
    tokens = torch.argmax(logits, dim=-1)
    hot = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if hot:
        h = torch.tensor(hot, device=logits.device)
        cdf = torch.cumsum(logp[h].exp(), dim=-1)
        u = torch.stack([1.0 - torch.rand((), generator=generators[i], device=logits.device) for i in hot])
        x = (u * cdf[:, -1]).to(cdf.dtype)[:, None]
        picked = torch.searchsorted(cdf, x).squeeze(1).clamp_(max=cdf.shape[1] - 1)
        tokens[h] = picked
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), chosen.tolist()

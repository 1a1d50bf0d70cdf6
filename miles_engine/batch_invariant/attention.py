"""Batch-invariant attention, registered with transformers as ``attn_implementation="batch_invariant"``.

A query's output is computed over *its own keys only, in position order, in fixed chunks*, so
the rollout engine's cached decode (one query against a ragged KV buffer with holes), its
batched prefill (left-padded, a cached prefix in front), the trainer's right-padded full
forward and its shared-prefix two-pass forward all add up exactly the same numbers:

1. The keys of a batch row are the ones its last query may see (every layout here ends a row
   with a query that sees all of them: a real last token, or a right-padding query that sees
   the whole row). They are compacted to slots ``0..n-1`` in column order, which is position
   order in every layout; a query's own keys are then a prefix of those slots.
2. Scores, ``exp`` and the weighted sum run per block of :data:`QUERY_BLOCK` queries and chunk
   of :data:`KEY_CHUNK` slots, each ``bmm`` of one fixed shape, the chunks accumulated one
   after the other in slot order. A chunk no query of the block may see is skipped (it would
   add exact zeros).
3. The softmax is two-pass: the exact maximum over the query's keys first, then the sums.

A query with no key (a left-padding query of the engine) gets zeros.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from miles_engine.batch_invariant.ops import elementwise

NAME = "batch_invariant"
QUERY_BLOCK = 16
KEY_CHUNK = 64


def _bool_mask(mask: Any, batch: int, q: int, kv: int, device: torch.device) -> Tensor:
    """``[batch, q, kv]`` bool (True: attend) from a 4-D bool / additive float mask or None (causal)."""
    if mask is None:
        cols = torch.arange(kv, device=device)
        causal = cols[None, :] <= (kv - q + torch.arange(q, device=device))[:, None]
        return causal[None].expand(batch, q, kv)
    if isinstance(mask, dict):  # mixed sliding layouts: not supported by this path
        raise ValueError("batch-invariant attention got per-layer-type masks; sliding-window models are not supported")
    if mask.dim() != 4:
        raise ValueError(f"batch-invariant attention needs a 4-D mask, got shape {tuple(mask.shape)}")
    m = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    return m[..., -kv:].expand(batch, q, kv)


def attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
              scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers attention interface: ``query [B, H, Q, D]``, ``key/value [B, Hk, L, D]`` ->
    ``([B, Q, H, D], None)``."""
    if dropout:
        raise ValueError("batch-invariant attention does not implement dropout (the trainer runs in eval mode)")
    if kwargs.get("sliding_window"):
        raise ValueError("batch-invariant attention does not support sliding-window layers")
    b, h, q, d = query.shape
    hk, kv = key.shape[1], key.shape[2]
    dev = query.device
    scale = d ** -0.5 if scaling is None else scaling
    mask = _bool_mask(attention_mask, b, q, kv, dev)
    keyset = mask[:, -1, :]
    rank = keyset.long().cumsum(-1) - 1
    n_max = int(keyset.sum(-1).max()) if b else 0
    slots = max(1, math.ceil(n_max / KEY_CHUNK)) * KEY_CHUNK
    bi, ji = keyset.nonzero(as_tuple=True)
    ri = rank[bi, ji]
    # compacted keys / values [B, slots, Hk, D] and per-query visibility [B, slots, Q]
    kc = key.new_zeros(b, slots, hk, d).index_put((bi, ri), key.transpose(1, 2)[bi, ji])
    vc = value.new_zeros(b, slots, hk, d).index_put((bi, ri), value.transpose(1, 2)[bi, ji])
    mc = torch.zeros(b, slots, q, dtype=torch.bool, device=dev).index_put((bi, ri), mask.transpose(1, 2)[bi, ji])
    rep = h // hk
    kc = kc.permute(0, 2, 1, 3)[:, :, None].expand(b, hk, rep, slots, d).reshape(b * h, slots, d)
    vc = vc.permute(0, 2, 1, 3)[:, :, None].expand(b, hk, rep, slots, d).reshape(b * h, slots, d)
    qpad = -q % QUERY_BLOCK
    qs = query.reshape(b * h, q, d)
    vis = mc.transpose(1, 2)[:, None].expand(b, h, q, slots).reshape(b * h, q, slots)
    if qpad:
        qs = torch.cat([qs, qs.new_zeros(b * h, qpad, d)], 1)
        vis = torch.cat([vis, vis.new_zeros(b * h, qpad, slots)], 1)
    key_chunks = [(kc[:, c:c + KEY_CHUNK].transpose(1, 2).contiguous(), vc[:, c:c + KEY_CHUNK].contiguous())
                  for c in range(0, slots, KEY_CHUNK)]
    outs = []
    for s in range(0, q + qpad, QUERY_BLOCK):
        qb = qs[:, s:s + QUERY_BLOCK].contiguous()
        vb = vis[:, s:s + QUERY_BLOCK]
        seen = vb.reshape(b * h, QUERY_BLOCK, -1, KEY_CHUNK).any(-1).any(1).any(0).tolist()
        scores = []
        for c, (kt, vv) in enumerate(key_chunks):
            if seen[c]:
                sc = torch.bmm(qb, kt) * scale
                scores.append((c, sc.masked_fill(~vb[:, :, c * KEY_CHUNK:(c + 1) * KEY_CHUNK], float("-inf")), vv))
        if not scores:
            outs.append(qb.new_zeros(b * h, QUERY_BLOCK, d))
            continue
        m = scores[0][1].amax(-1)
        for _, sc, _ in scores[1:]:
            m = torch.maximum(m, sc.amax(-1))
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)[..., None]
        total = out = None
        for _, sc, vv in scores:
            p = elementwise(torch.exp, sc - m)
            part, weighted = p.sum(-1), torch.bmm(p, vv)
            total = part if total is None else total + part
            out = weighted if out is None else out + weighted
        outs.append(out / torch.where(total > 0, total, torch.ones_like(total))[..., None])
    result = torch.cat(outs, 1)[:, :q] if len(outs) > 1 or qpad else outs[0]
    return result.reshape(b, h, q, d).transpose(1, 2).contiguous(), None


def mask_function(*args: Any, **kwargs: Any) -> Any:
    """transformers' sdpa boolean mask, never skipped (a ``None`` "just be causal" would lose padding)."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Make ``attn_implementation="batch_invariant"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, mask_function)

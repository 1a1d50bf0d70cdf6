"""``miles_sdpa``: transformers' SDPA attention, with grouped-query heads packed for multi-token
queries too.

transformers runs a multi-token query against a masked cache by repeating every key/value head
(``repeat_kv``): a copy of the whole KV window per layer and forward — for a speculative verify
forward over k + 1 tokens that copy costs more than the attention itself. Here the query heads that
share a key/value head are folded into the query length instead (``[b, kv_heads, groups * q, d]``,
the mask repeated per group), so SDPA reads the cache in place, as transformers already does for a
single query token. Anything else (one token, no GQA, extra attention inputs) is transformers' own.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "miles_sdpa"


def packed_gqa_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    q = query.shape[2]
    plain = (groups == 1 or q == 1 or attention_mask is None or dropout != 0.0 or attention_mask.shape[1] != 1
             or any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "s_aux")))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    b, heads, _, d = query.shape
    kv_heads = heads // groups
    # head g * groups + r attends with key/value head g (repeat_kv's order): row r * q + t of group g
    packed = query.reshape(b, kv_heads, groups * q, d)
    mask = attention_mask[..., -key.shape[2]:].repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, heads, q, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, packed_gqa_sdpa)

"""Log-probs of a prompt's own tokens (SGLang's input logprobs), from one teacher-forced forward pass.

Runs on the engine thread (between two scheduler steps, so a weight update never lands in the
middle of it) with a plain ``model(input_ids)`` call that leaves the engine's KV cache alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PromptLogprobs:
    """Values for tokens ``start + 1 .. len(ids) - 1`` (the token at ``start`` has no predicting
    position in the pass, exactly like SGLang's leading ``None``), in row order.

    :param token: log-prob of each of those tokens.
    :param top_ids, top_logprobs: per token, the ``top_n`` most likely ids at its predicting
        position (ties broken by the lower id) and their log-probs; empty when ``top_n`` is 0.
    :param asked: per token, log-probs of the requested ``token_ids`` (same order); empty when none.
    """

    token: list[float]
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    asked: list[list[float]] = field(default_factory=list)


def score_prompt(model: Any, ids: Sequence[int], start: int, top_n: int = 0,
                 token_ids: Sequence[int] | None = None, kv_quant: Callable[[Any], Any] | None = None) -> PromptLogprobs:
    """``kv_quant``: the KV cache's format (an FP8 KV cache): attention reads keys and values as the
    generating engine stores them, so a prompt is scored as it is sampled."""
    import torch

    device = next(model.parameters()).device
    row = torch.tensor([list(ids)], dtype=torch.long, device=device)
    with torch.inference_mode():
        if kv_quant is None:
            out_logits = model(input_ids=row, use_cache=False).logits
        else:
            cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
            out_logits = model(input_ids=row, use_cache=True, **{cache_arg: _quantising_cache(kv_quant)}).logits
        logits = out_logits[0, start:len(ids) - 1]
        from miles_engine.batch_invariant import is_enabled, log_softmax

        logp = log_softmax(logits.float()) if is_enabled(model) else torch.log_softmax(logits.float(), dim=-1)
        targets = row[0, start + 1:]
        out = PromptLogprobs(logp.gather(1, targets[:, None]).squeeze(1).tolist())
        if top_n and len(targets):
            order = torch.sort(logp, dim=-1, descending=True, stable=True)
            k = min(top_n, logp.shape[-1])
            out.top_ids = order.indices[:, :k].tolist()
            out.top_logprobs = order.values[:, :k].tolist()
        if token_ids:
            idx = torch.tensor(list(token_ids), dtype=torch.long, device=device)
            out.asked = logp.index_select(1, idx).tolist()
    return out


def _quantising_cache(kv_quant: Callable[[Any], Any]) -> Any:
    from transformers import DynamicCache

    class QuantisingCache(DynamicCache):
        def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
            return super().update(kv_quant(key_states), kv_quant(value_states), layer_idx, *args, **kwargs)

    return QuantisingCache()

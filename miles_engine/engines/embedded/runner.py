"""Forward passes of the embedded engine: batched prefill and one batched decode step.

Both run the unmodified transformers model with our :class:`RaggedKV` as its cache, explicit
per-row ``position_ids`` and a prepared 4-D attention mask (transformers passes a 4-D mask
through untouched), and ask for the last position's logits only (``logits_to_keep=1``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from miles_engine.engines.embedded.kv_cache import KVCodec, RaggedKV
from miles_engine.engines.embedded.moe import RouterCapture
from miles_engine.engines.embedded.sessions import SessionHit


@dataclass
class PrefillItem:
    tokens: list[int]  # the part to run through the model
    start: int  # position of tokens[0] (= length of the reused prefix)
    hit: SessionHit | None


class ModelRunner:
    def __init__(self, model: Any, *, pad_token_id: int = 0,
                 kv_codec: KVCodec | None = None) -> None:
        self.model = model
        self.kv_codec = kv_codec
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        config = model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers = int(text.num_hidden_layers)
        self.capture = RouterCapture(model)
        attn = getattr(config, "_attn_implementation", None) or "eager"
        self.float_mask = None if attn in ("sdpa", "miles_sdpa", "batch_invariant") else self.dtype
        self.invariant = attn == "batch_invariant"  # true on-policy: the sampler's log-softmax too
        layer_types = list(getattr(text, "layer_types", None) or [])
        window = getattr(text, "sliding_window", None)
        self.mixed_sliding = "sliding_attention" in layer_types and "full_attention" in layer_types
        all_sliding = bool(window) and getattr(text, "use_sliding_window", True) is not False and (
            not layer_types or set(layer_types) == {"sliding_attention"})
        self.window = int(window) if window and (self.mixed_sliding or all_sliding) else None
        self.mask_key_full = not (all_sliding and self.window)
        params = inspect.signature(model.forward).parameters
        self.keep_arg = "logits_to_keep" in params
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.pad_token_id = pad_token_id
        self.batch = RaggedKV(self.num_layers, device=self.device, dtype=self.dtype, kv_codec=kv_codec)

    def _mask(self, cache: RaggedKV, q: int) -> Any:
        full = cache.attention_mask(q, float_dtype=self.float_mask)
        if self.window is None:
            return full
        sliding = cache.attention_mask(q, float_dtype=self.float_mask, sliding_window=self.window)
        if self.mixed_sliding:
            return {"full_attention": full, "sliding_attention": sliding}
        return sliding

    def _forward(self, cache: RaggedKV, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
                 all_logits: bool = False):
        cache.begin_forward(valid, pos)
        kwargs: dict[str, Any] = dict(input_ids=ids, position_ids=pos, attention_mask=self._mask(cache, ids.shape[1]),
                                      use_cache=True)
        kwargs[self.cache_arg] = cache
        if self.keep_arg and not all_logits:
            kwargs["logits_to_keep"] = 1
        self.capture.start()
        try:
            out = self.model(**kwargs)
        except BaseException:
            cache._pending = 0
            self.capture.stop()
            raise
        cache.end_forward()
        routing = self.capture.take(ids.shape[0], ids.shape[1])
        return (out.logits if all_logits else out.logits[:, -1, :]), routing

    def prefill(self, items: list[PrefillItem]) -> tuple[torch.Tensor, list[torch.Tensor | None], RaggedKV]:
        """Run the new tokens of ``items`` (each after its cached prefix, if any) as one
        left-padded batch. Returns last-position logits [n, vocab], per-item routing of the
        new tokens ([len(tokens), layers, top_k] or None) and the filled cache."""
        n = len(items)
        s_max = max(len(it.tokens) for it in items)
        cache = RaggedKV(self.num_layers, device=self.device, dtype=self.dtype, kv_codec=self.kv_codec)
        cache.load_prefix([(it.hit.keys, it.hit.values) if it.hit else None for it in items])
        ids = torch.full((n, s_max), self.pad_token_id, dtype=torch.long)
        pos = torch.zeros((n, s_max), dtype=torch.long)
        valid = torch.zeros((n, s_max), dtype=torch.bool)
        for r, it in enumerate(items):
            s = len(it.tokens)
            ids[r, s_max - s :] = torch.tensor(it.tokens, dtype=torch.long)
            pos[r, s_max - s :] = torch.arange(it.start, it.start + s)
            valid[r, s_max - s :] = True
        logits, routing = self._forward(cache, ids.to(self.device), pos.to(self.device), valid.to(self.device))
        per_item = [routing[r, s_max - len(it.tokens) :] if routing is not None else None
                    for r, it in enumerate(items)]
        return logits, per_item, cache

    def decode(self, tokens: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step for every row of the running batch; returns logits [rows, vocab] and
        routing [rows, layers, top_k] (MoE) of the fed tokens."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)[:, None]
        valid = torch.ones_like(ids, dtype=torch.bool)
        logits, routing = self._forward(self.batch, ids, pos, valid)
        return logits, (routing[:, 0] if routing is not None else None)

    def forward_rows(self, cache: RaggedKV, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
                     *, all_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of ``q = ids.shape[1]`` columns for every row of ``cache`` (``valid``
        False: a pad column, attended by nobody). Returns logits [rows, q, vocab] when
        ``all_logits`` (else the last column's [rows, vocab]) and routing [rows, q, layers, top_k]."""
        dev = self.device
        return self._forward(cache, ids.to(dev), pos.to(dev), valid.to(dev), all_logits=all_logits)

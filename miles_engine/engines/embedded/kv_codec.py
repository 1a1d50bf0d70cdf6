"""How the embedded engine's KV cache holds keys and values when they are not kept as computed.

``fp8`` (``precision.kv_cache: fp8``): each vector (one token of one head) is stored as its E4M3
codes followed by the four bytes of its float32 scale, one row of ``head_dim + 4`` bytes -- so every
operation of :class:`~miles_engine.engines.embedded.kv_cache.RaggedKV` that moves, gathers or
copies cache columns (and the prompt and session caches, which keep rows of it) moves codes and
scales together without knowing about them. Attention reads the window decoded to the model's
dtype: exactly :func:`~miles_engine.precision.quantizer.kv_fp8`'s values. A float32 cache takes a
quarter of the memory (plus 4 bytes per vector), a bfloat16 one about half."""

from __future__ import annotations

import torch

from miles_engine.precision.quantizer import kv_fp8_decode, kv_fp8_encode

_SCALE_BYTES = 4


class FP8KVCodec:
    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., d]`` keys or values -> ``[..., d + 4]`` uint8 (codes, then the scale's bytes)."""
        codes, scale = kv_fp8_encode(x)
        return torch.cat([codes, scale.contiguous().view(torch.uint8)], dim=-1)

    def unpack(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        scale = stored[..., -_SCALE_BYTES:].contiguous().view(torch.float32)
        return kv_fp8_decode(stored[..., :-_SCALE_BYTES], scale, dtype)


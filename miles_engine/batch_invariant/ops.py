"""Batch-invariant row operations: a row's result depends on the row alone.

Why the plain ops are not: a BLAS matmul picks its kernel from the shapes (one decode row runs a
matrix-vector kernel whose reduction order differs from the matrix-matrix kernel of a
600-row training batch), and a vectorised elementwise loop computes the last ``numel mod 32``
elements with the scalar version of the function (``silu``, ``exp``: 1 ulp apart from the SIMD
version), so where a row sits in the flattened tensor changes its rounding.

The remedy used throughout: rows run in **fixed-shape blocks**. Every call of a kernel sees
exactly ``[BLOCK_ROWS, columns]`` (rows zero-padded to a whole block), so the kernel choice and
its reduction order are the same for every row of every batch; elementwise functions also get
their columns zero-padded to a multiple of :data:`LANES` and at most :data:`MAX_ELEMENTWISE`
elements per call (no scalar tail, no split across intra-op threads). Measured on this box:
a row's result inside such a block does not depend on its position or on its neighbours
(``tests/batch_invariant``), while ``torch.mm`` with 1, 2, 3 or 7 rows differs from it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

BLOCK_ROWS = 32  # rows per kernel call
LANES = 64  # elementwise calls see a multiple of this many columns (2 x AVX-512 floats, and then some)
MAX_ELEMENTWISE = 1 << 15  # elements per elementwise call: at::parallel_for's grain, so one thread runs it


def _pad_rows(x: Tensor, multiple: int) -> Tensor:
    extra = -x.shape[0] % multiple
    if not extra:
        return x
    return torch.cat([x, x.new_zeros((extra, *x.shape[1:]))])


def row_blocks(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``fn`` on ``x`` ([rows, ...]) in blocks of exactly :data:`BLOCK_ROWS` rows; rows
    ``[rows, ...]`` of the results concatenated (``fn`` must keep the row dimension)."""
    rows = x.shape[0]
    xp = _pad_rows(x, BLOCK_ROWS)
    outs = [fn(xp[i:i + BLOCK_ROWS]) for i in range(0, xp.shape[0], BLOCK_ROWS)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:rows] if out.shape[0] != rows else out


def elementwise(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """A pointwise ``fn`` (silu, exp, ...) with every element on the SIMD path: the last
    dimension zero-padded to a multiple of :data:`LANES`, at most :data:`MAX_ELEMENTWISE`
    elements per call."""
    shape = x.shape
    cols = shape[-1] if x.dim() else 1
    flat = x.reshape(-1, cols)
    pad = -cols % LANES
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    width = flat.shape[1]
    step = max(1, MAX_ELEMENTWISE // width)
    outs = [fn(flat[i:i + step]) for i in range(0, flat.shape[0], step)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    rows = x.numel() // cols if x.dim() else 1
    return out[:rows, :cols].reshape(shape)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` over the last dimension, each block of rows one ``mm`` of a fixed
    shape (the bias is added after the product, never folded into the kernel)."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    wt = weight.t()
    out = row_blocks(lambda b: torch.mm(b, wt), flat)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' Llama / Qwen RMSNorm (float32 statistics, weight applied in the input dtype)."""
    dtype = x.dtype
    flat = x.reshape(-1, x.shape[-1]).to(torch.float32)

    def block(b: Tensor) -> Tensor:
        variance = b.pow(2).mean(-1, keepdim=True)
        return b * torch.rsqrt(variance + eps)

    normed = row_blocks(block, flat).reshape(x.shape)
    return weight * normed.to(dtype)


def log_softmax(x: Tensor) -> Tensor:
    """``log_softmax`` over the last dimension, float32 in, float32 out."""
    flat = x.reshape(-1, x.shape[-1])
    return row_blocks(lambda b: torch.log_softmax(b, dim=-1), flat).reshape(x.shape)


def softmax(x: Tensor) -> Tensor:
    """``softmax`` over the last dimension in float32."""
    flat = x.reshape(-1, x.shape[-1]).float()
    return row_blocks(lambda b: torch.softmax(b, dim=-1), flat).reshape(x.shape)

"""The one quantizer every stage uses: checkpoint conversion, the trainer's forward (QAT), the
online export and the engine. Same input, same bytes, on any backend: every step is an IEEE
float32 operation (correctly rounded everywhere), an exact power-of-two scaling built from bits,
or a rounding to nearest even of a value already clamped into range.

Special values: a block holding NaN or +-Inf decodes to NaN as a whole (its scale is NaN); an
all-zero block gets a neutral scale and zero codes. Formats: :mod:`miles_engine.precision.formats`.

A tensor of more than two dimensions is a stack of matrices (a MoE layer's experts,
``[experts, out, in]``): each is quantised as a weight of its own (its own FP8 tiles, its own
NVFP4 tensor scale), the parts stacked along the rows in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from miles_engine.precision import elements as el
from miles_engine.precision.formats import QuantFormat, get_format

_NVFP4_RANGE = el.E2M1_MAX * el.E4M3_MAX  # 2688: the largest |value| one block scale times E2M1 can hold


@dataclass(frozen=True)
class Quantized:
    """A tensor in a quantised format: ``codes`` (uint8; two per byte for 4-bit formats), the block
    ``scales`` (float32, or uint8 codes for mxfp8 / nvfp4) and nvfp4's per-tensor float32 scale."""

    format: str
    shape: tuple[int, ...]
    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        extra = 0 if self.tensor_scale is None else self.tensor_scale.numel() * 4
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size() + extra

    def parts(self) -> dict[str, torch.Tensor]:
        """The tensors that travel (names are suffixes: ``codes``, ``scales``, ``tensor_scale``)."""
        out = {"codes": self.codes, "scales": self.scales}
        if self.tensor_scale is not None:
            out["tensor_scale"] = self.tensor_scale
        return out


class QuantizeError(ValueError):
    """A tensor this format cannot hold (its last dimension is not a multiple of the block)."""


def _as_matrix(x: torch.Tensor, fmt: QuantFormat, name: str) -> torch.Tensor:
    cols = x.shape[-1] if x.dim() else 1
    if fmt.block_rows == 1 and cols % fmt.block_cols:
        raise QuantizeError(f"{name or 'tensor'} of shape {tuple(x.shape)}: {fmt.name} needs the last dimension to "
                            f"be a multiple of {fmt.block_cols}; keep it in high precision (precision.exceptions)")
    return x.detach().float().reshape(-1, cols)


def _blocks(m: torch.Tensor, cols: int) -> torch.Tensor:
    return m.reshape(m.shape[0], m.shape[1] // cols, cols)


def _block_amax(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax over finite values, whether the block holds a NaN or an infinity)."""
    finite = torch.isfinite(blocks)
    return blocks.abs().masked_fill(~finite, 0.0).amax(dim=-1), ~finite.all(dim=-1)


def quantize(x: torch.Tensor, fmt: str | QuantFormat, name: str = "") -> Quantized:
    """``x`` (any floating dtype, any device) in ``fmt``; ``name`` only labels errors."""
    f = get_format(fmt) if isinstance(fmt, str) else fmt
    if x.dim() > 2:  # a stack of matrices, each its own weight
        each = [quantize(m, f, name) for m in x.reshape(-1, *x.shape[-2:])]
        scales = None if each[0].tensor_scale is None else torch.cat([q.tensor_scale for q in each])
        return Quantized(f.name, tuple(x.shape), torch.cat([q.codes for q in each]),
                         torch.cat([q.scales for q in each]), scales)
    m = _as_matrix(x, f, name)
    out = {"fp8": _fp8_tiles, "mxfp8": _mxfp8, "nvfp4": _nvfp4, "int4": _int4}[f.name](m, f)
    return Quantized(f.name, tuple(x.shape), *out)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``q`` stands for (float32 arithmetic, then cast to ``dtype``)."""
    f = get_format(q.format)
    if len(q.shape) > 2:
        return torch.stack([dequantize(m, dtype) for m in matrices(q)]).reshape(q.shape)
    cols = q.shape[-1] if q.shape else 1
    if f.name == "fp8":
        values = _times_tile_scales(el.e4m3_decode(q.codes), q.scales, f)
    else:
        decoded = (el.unpack_decode(q.codes, "e2m1" if f.name == "nvfp4" else "int4") if f.packed
                   else el.e4m3_decode(q.codes))
        blocks = decoded.reshape(decoded.shape[0], cols // f.block_cols, f.block_cols)
        if f.name == "mxfp8":
            values = blocks * el.ue8m0_decode(q.scales).unsqueeze(-1)
        elif f.name == "nvfp4":
            values = blocks * _nvfp4_divisor(q.scales, q.tensor_scale).unsqueeze(-1)
        else:
            values = blocks * q.scales.unsqueeze(-1)
    return values.reshape(q.shape).to(dtype)


def matrices(q: Quantized) -> list[Quantized]:
    """The matrices of a stacked ``q`` (``[..., out, in]``), each as quantised on its own."""
    n = math.prod(q.shape[:-2])
    shape = tuple(q.shape[-2:])
    tensor = [None] * n if q.tensor_scale is None else list(q.tensor_scale.reshape(n, 1))
    return [Quantized(q.format, shape, c, s, t)
            for c, s, t in zip(q.codes.chunk(n), q.scales.chunk(n), tensor)]


def _times_tile_scales(values: torch.Tensor, per_tile: torch.Tensor, f: QuantFormat) -> torch.Tensor:
    """``values * _expand_tiles(per_tile)`` by broadcasting (the same float32 products, without
    materialising the expanded scales): whole column blocks at once, a partial last one apart."""
    rows, cols = values.shape
    row_scales = per_tile.repeat_interleave(f.block_rows, 0)[:rows]  # rows x column tiles
    whole = cols // f.block_cols * f.block_cols
    if whole == cols:
        return (values.reshape(rows, -1, f.block_cols) * row_scales[:, :, None]).reshape(rows, cols)
    out = torch.empty_like(values)
    if whole:
        out[:, :whole] = (values[:, :whole].reshape(rows, -1, f.block_cols)
                          * row_scales[:, : whole // f.block_cols, None]).reshape(rows, whole)
    if whole < cols:
        out[:, whole:] = values[:, whole:] * row_scales[:, -1:]
    return out


def fake_quantize(x: torch.Tensor, fmt: str | QuantFormat, name: str = "") -> torch.Tensor:
    """The quantised values of ``x`` in ``x``'s dtype, with the gradient passing straight through
    (quantisation-aware training): forward sees exactly what the engine computes with."""
    exact = dequantize(quantize(x, fmt, name), x.dtype)
    return x + (exact - x).detach()


def _expand_tiles(per_tile: torch.Tensor, shape: torch.Size, f: QuantFormat) -> torch.Tensor:
    rows, cols = shape
    return per_tile.repeat_interleave(f.block_rows, 0)[:rows].repeat_interleave(f.block_cols, 1)[:, :cols]


def _fp8_tiles(m: torch.Tensor, f: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = m.shape
    tr, tc = math.ceil(rows / f.block_rows), math.ceil(cols / f.block_cols)
    padded = torch.zeros(tr * f.block_rows, tc * f.block_cols, device=m.device)
    padded[:rows, :cols] = m
    tiles = padded.reshape(tr, f.block_rows, tc, f.block_cols).transpose(1, 2).reshape(tr, tc, -1)
    amax, special = _block_amax(tiles)
    scales = torch.where(amax > 0, amax / el.E4M3_MAX, torch.ones_like(amax)).masked_fill(special, float("nan"))
    codes = el.e4m3_encode(m / _expand_tiles(scales, m.shape, f))
    return codes, scales


def _mxfp8(m: torch.Tensor, f: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = _blocks(m, f.block_cols)
    amax, special = _block_amax(blocks)
    # OCP MX v1.0: shared exponent = floor(log2(amax)) - emax(E4M3) = floor(log2(amax)) - 8, within
    # UE8M0's range; frexp gives amax = mantissa * 2**e with mantissa in [0.5, 1), so floor(log2) = e - 1.
    _, e = torch.frexp(amax)
    shared = torch.where(amax > 0, e - 1 - 8, torch.full_like(e, -el.UE8M0_BIAS)).clamp(-el.UE8M0_BIAS, el.UE8M0_BIAS)
    codes = el.e4m3_encode(blocks * el.power_of_two(-shared).unsqueeze(-1))
    scales = (shared + el.UE8M0_BIAS).to(torch.uint8).masked_fill(special, el.UE8M0_NAN)
    codes = codes.masked_fill(special.unsqueeze(-1), 0)
    return codes.reshape(m.shape), scales


def _nvfp4_divisor(scale_codes: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    return el.e4m3_decode(scale_codes) * tensor_scale


def _nvfp4(m: torch.Tensor, f: QuantFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = _blocks(m, f.block_cols)
    amax, special = _block_amax(blocks)
    tensor_amax = amax.max() if amax.numel() else torch.zeros((), device=m.device)
    tensor_scale = torch.where(tensor_amax > 0, tensor_amax / _NVFP4_RANGE, torch.ones_like(tensor_amax))
    scale_codes = el.e4m3_encode(amax / el.E2M1_MAX / tensor_scale)
    divisor = _nvfp4_divisor(scale_codes, tensor_scale).unsqueeze(-1)
    scaled = torch.where(divisor > 0, blocks / divisor, torch.zeros_like(blocks))
    codes = el.e2m1_encode(scaled).masked_fill(special.unsqueeze(-1), 0)
    scale_codes = scale_codes.masked_fill(special, el.E4M3_NAN)
    return el.pack_nibbles(codes.reshape(m.shape)), scale_codes, tensor_scale.reshape(1)


def _int4(m: torch.Tensor, f: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = _blocks(m, f.block_cols)
    amax, special = _block_amax(blocks)
    scales = torch.where(amax > 0, amax / el.INT4_MAX, torch.ones_like(amax)).masked_fill(special, float("nan"))
    q = torch.round(blocks / scales.unsqueeze(-1)).nan_to_num(0.0).clamp(el.INT4_MIN, el.INT4_MAX)
    return el.pack_nibbles(el.int4_encode(q).reshape(m.shape)), scales


def kv_fp8(x: torch.Tensor) -> torch.Tensor:
    """The FP8 KV cache's values of ``x`` (in ``x``'s dtype): E4M3 with a float32 scale per vector
    along the last dimension (one token of one head), ``amax / 448``; special values as the formats'."""
    return kv_fp8_decode(*kv_fp8_encode(x), x.dtype)


def kv_fp8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 E4M3 codes shaped like ``x``, float32 scales ``[..., 1]``) of the FP8 KV cache."""
    v = x.detach().float()
    amax, special = _block_amax(v)
    scale = torch.where(amax > 0, amax / el.E4M3_MAX, torch.ones_like(amax)).masked_fill(special, float("nan"))
    scale = scale.unsqueeze(-1)
    return el.e4m3_encode(v / scale), scale


def kv_fp8_decode(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (el.e4m3_decode(codes) * scale).to(dtype)

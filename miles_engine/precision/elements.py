"""Element encodings of the low-precision formats, as byte codes.

- E4M3 (OCP FP8, the ``fn`` variant): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinity,
  ``S.1111.111`` is NaN, largest finite 448. Rounding is to nearest, ties to even; the value is
  clamped to +-448 first, so saturation never depends on a backend's cast.
- E2M1 (OCP FP4): 1 sign, 2 exponent (bias 1), 1 mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6};
  no NaN or infinity. Two codes share a byte, the first element in the low nibble.
- UE8M0 (OCP MX scale): an unsigned 8-bit exponent, value ``2**(code - 127)``; 255 is NaN.
- INT4: two's complement, -8..7, packed like E2M1.
"""

from __future__ import annotations

from functools import lru_cache

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E4M3_NAN = 0x7F
INT4_MIN, INT4_MAX = -8, 7
UE8M0_BIAS = 127
UE8M0_NAN = 255

_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# |x| at or past each bound moves one code up; a tie goes to the even code (mantissa bit 0), so
# the bounds alternate between "above" (>) and "at or above" (>=): 0.25 -> 0, 0.75 -> 1.0, ...
_E2M1_ABOVE = (0.25, 1.25, 2.5, 5.0)
_E2M1_AT_OR_ABOVE = (0.75, 1.75, 3.5)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 -> uint8 E4M3 codes (round to nearest even, clamped to +-448; NaN -> 0x7F, whatever
    its sign bit, so the bytes do not depend on how a backend propagates NaN signs)."""
    x = x.float()
    codes = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.masked_fill(torch.isnan(x), E4M3_NAN)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 codes -> float32: torch's own conversion, looked up in a 256-entry table (the
    conversion is a per-element scalar loop on CPU, ~6x slower than the lookup)."""
    return _lookup(_table("e4m3", codes.device), codes)


def _lookup(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``table[codes]`` (rows of ``table`` for a 2-D one, flattened into the last dimension)."""
    flat = table.index_select(0, codes.reshape(-1).to(torch.int32))
    return flat.reshape(*codes.shape[:-1], -1) if codes.dim() else flat.reshape(table.shape[1:])


@lru_cache(maxsize=16)
def _table(kind: str, device: torch.device) -> torch.Tensor:
    """Decoding tables, built from the definitions below: ``e4m3`` (256 values), and for a byte of two
    packed 4-bit codes (low nibble first) ``e2m1x2`` / ``int4x2`` (256 x 2 values)."""
    byte = torch.arange(256, dtype=torch.uint8)
    if kind == "e4m3":
        table = byte.view(torch.float8_e4m3fn).float()
    else:
        decode = e2m1_decode if kind == "e2m1x2" else int4_decode
        table = torch.stack((decode(byte & 0xF), decode(byte >> 4)), dim=-1)
    return table.to(device)


def unpack_decode(packed: torch.Tensor, kind: str) -> torch.Tensor:
    """Bytes of two 4-bit codes (``e2m1`` or ``int4``) -> float32 values, twice as many along the
    last dimension: ``decode(unpack_nibbles(packed))`` in one lookup."""
    return _lookup(_table(f"{kind}x2", packed.device), packed)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 -> uint8 E2M1 codes 0..15 (round to nearest even, clamped to +-6; NaN -> +0)."""
    x = x.float()
    magnitude = torch.nan_to_num(x.abs(), nan=0.0).clamp(max=E2M1_MAX)
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for bound in _E2M1_ABOVE:
        code += (magnitude > bound).to(torch.uint8)
    for bound in _E2M1_AT_OR_ABOVE:
        code += (magnitude >= bound).to(torch.uint8)
    sign = torch.signbit(x) & ~torch.isnan(x)
    return code | (sign.to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(_E2M1_VALUES + tuple(-v for v in _E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def ue8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """UE8M0 codes -> float32 ``2**(code - 127)`` (255 -> NaN), built from the bits: exact."""
    return power_of_two(codes.to(torch.int32) - UE8M0_BIAS).masked_fill(codes == UE8M0_NAN, float("nan"))


def power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """int32 exponents in [-149, 127] -> float32 ``2**exponent``, exact (built from the bit pattern)."""
    e = exponent.to(torch.int32)
    normal = ((e.clamp(min=-126) + 127) << 23).view(torch.float32)
    subnormal = (torch.ones_like(e) << (e.clamp(-149, -127) + 149)).view(torch.float32)
    return torch.where(e >= -126, normal, subnormal)


def int4_encode(q: torch.Tensor) -> torch.Tensor:
    """Integers in -8..7 -> uint8 nibbles (two's complement)."""
    return (q.to(torch.int16) & 0xF).to(torch.uint8)


def int4_decode(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.int16)
    return torch.where(c >= 8, c - 16, c).float()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15, last dimension even -> half as many bytes (element 2i low, 2i+1 high)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"packing 4-bit codes needs an even last dimension, got {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)

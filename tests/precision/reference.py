"""A slow reference of the quantised formats, written from the specifications with exact rational
arithmetic (no torch casts, no numpy): IEEE-754 round-to-nearest-even into a binary format with a
given mantissa width and minimum exponent, used for float32 itself (each float32 operation the
formats define is the exact result rounded once), E4M3 and E2M1.

Formats (miles_engine/precision/formats.py documents the same rules):
- fp8:   per 128x128 tile, scale = f32(amax / 448); element = E4M3(f32(x / scale)); zero tile: scale 1.
- mxfp8: per 32, OCP MX v1.0 section 6.3: X = 2**(floor(log2(amax)) - 8) in [2**-127, 2**127]
         (zero block: 2**-127); element = E4M3(x / X) with saturation to +-448.
- nvfp4: tensor scale g = f32(amax_t / 2688) (zero tensor: 1); per 16: s = E4M3(f32(f32(amax_b / 6) / g));
         d = f32(s * g); element = E2M1(f32(x / d)) (d = 0: element 0), saturating at +-6.
- int4:  per 32, scale = f32(amax / 7) (zero: 1); element = round-half-even(f32(x / scale)) in [-8, 7].
A block with a NaN or an infinity: scale NaN (fp8 / int4: float NaN; mxfp8: 255; nvfp4: E4M3 0x7F),
elements 0 (fp8: E4M3 NaN 0x7F, as x / NaN).
"""

from __future__ import annotations

import math
from fractions import Fraction

F32 = (23, -126)
E4M3 = (3, -6)
E2M1 = (1, 0)
E4M3_MAX, E2M1_MAX = Fraction(448), Fraction(6)


def round_binary(v: Fraction, mantissa_bits: int, min_exp: int) -> Fraction:
    """``v`` rounded to nearest, ties to even, into a binary float format (unbounded above)."""
    if v == 0:
        return Fraction(0)
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    if Fraction(2) ** (e + 1) <= a:
        e += 1
    quantum = Fraction(2) ** (max(e, min_exp) - mantissa_bits)
    n = a / quantum
    whole = n.numerator // n.denominator
    rest = n - whole
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2):
        whole += 1
    return (1 if v > 0 else -1) * whole * quantum


def f32(v: Fraction) -> Fraction:
    return round_binary(v, *F32)


def _e4m3_table() -> dict[Fraction, int]:
    table = {}
    for code in range(128):
        e, m = code >> 3, code & 7
        if e == 15 and m == 7:
            continue  # NaN
        table[Fraction(m, 8) * Fraction(2) ** -6 if e == 0 else (1 + Fraction(m, 8)) * Fraction(2) ** (e - 7)] = code
    return table


E4M3_CODES = _e4m3_table()
E2M1_CODES = {Fraction(v): c for c, v in enumerate(("0", "1/2", "1", "3/2", "2", "3", "4", "6"))}


def _signed_code(x: float | Fraction, value: Fraction, codes: dict[Fraction, int], sign_bit: int) -> int:
    negative = x < 0 or (x == 0 and math.copysign(1.0, float(x)) < 0)
    return codes[abs(value)] | (sign_bit if negative else 0)


def e4m3(x: float | Fraction) -> int:
    if isinstance(x, float) and math.isnan(x):
        return 0x7F
    v = max(-E4M3_MAX, min(E4M3_MAX, Fraction(x)))
    return _signed_code(x, round_binary(v, *E4M3), E4M3_CODES, 0x80)


def e2m1(x: float | Fraction) -> int:
    v = max(-E2M1_MAX, min(E2M1_MAX, Fraction(x)))
    return _signed_code(x, round_binary(v, *E2M1), E2M1_CODES, 0x8)


def e4m3_value(code: int) -> Fraction:
    value = next(v for v, c in E4M3_CODES.items() if c == code & 0x7F)
    return -value if code & 0x80 else value


def _amax(block: list[float]) -> tuple[Fraction, bool]:
    special = any(math.isnan(v) or math.isinf(v) for v in block)
    return max((abs(Fraction(v)) for v in block if math.isfinite(v)), default=Fraction(0)), special


def fp8_tile(tile: list[float]) -> tuple[list[int], float]:
    amax, special = _amax(tile)
    if special:
        return [0x7F] * len(tile), math.nan
    scale = f32(amax / E4M3_MAX) if amax else Fraction(1)
    return [e4m3(f32(Fraction(v) / scale) if v else v) for v in tile], float(scale)


def mxfp8_block(block: list[float]) -> tuple[list[int], int]:
    amax, special = _amax(block)
    if special:
        return [0] * len(block), 255
    if amax == 0:
        shared = -127
    else:
        _, e = math.frexp(float(amax))
        shared = max(-127, min(127, e - 1 - 8))
    x = Fraction(2) ** shared
    return [e4m3(Fraction(v) / x if v else v) for v in block], shared + 127


def nvfp4_tensor_scale(values: list[float]) -> Fraction:
    amax = max((abs(Fraction(v)) for v in values if math.isfinite(v)), default=Fraction(0))
    return f32(amax / 2688) if amax else Fraction(1)


def nvfp4_block(block: list[float], g: Fraction) -> tuple[list[int], int]:
    amax, special = _amax(block)
    s = e4m3(f32(f32(amax / 6) / g))
    if special:
        return [0] * len(block), 0x7F
    d = f32(e4m3_value(s) * g)
    return [e2m1(f32(Fraction(v) / d) if d and v else (v if d else 0.0)) for v in block], s


def int4_group(group: list[float]) -> tuple[list[int], float]:
    amax, special = _amax(group)
    if special:
        return [0] * len(group), math.nan
    scale = f32(amax / 7) if amax else Fraction(1)
    out = []
    for v in group:
        q = f32(Fraction(v) / scale)
        whole = math.floor(q)
        rest = q - whole
        if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2):
            whole += 1
        out.append(max(-8, min(7, whole)) & 0xF)
    return out, float(scale)

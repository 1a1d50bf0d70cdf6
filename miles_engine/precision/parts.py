"""A quantised tensor on the wire: the online export quantises on the trainer side once and ships
the codes and scales (fewer bytes than the full-precision tensor); the engine joins them back.

A weight ``W`` of an engine that holds format ``F`` travels as ``W:q.codes``, ``W:q.scales`` and,
for nvfp4, ``W:q.tensor_scale`` -- their dtypes and shapes follow from ``W``'s shape and ``F``
(:func:`part_specs`), so both sides check them without more metadata.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from miles_engine.precision.formats import get_format

SEPARATOR = ":q."
_PARTS = ("codes", "scales", "tensor_scale")


def split_name(name: str) -> tuple[str, str] | None:
    """``(weight name, part)`` of a part's name; None for a plain tensor's."""
    base, sep, part = name.rpartition(SEPARATOR)
    return (base, part) if sep and part in _PARTS else None


def part_specs(name: str, shape: tuple[int, ...], fmt: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{part name: (dtype name, shape)}`` of weight ``name`` of ``shape`` in ``fmt``."""
    f = get_format(fmt)
    cols = shape[-1] if shape else 1
    rows = shape[-2] if len(shape) > 1 else 1
    stacked = math.prod(shape[:-2]) if len(shape) > 2 else 1  # matrices quantised each on its own
    codes = (stacked * rows, cols // 2) if f.packed else (stacked * rows, cols)
    if f.name == "fp8":
        scales = ("float32", (stacked * math.ceil(rows / f.block_rows), math.ceil(cols / f.block_cols)))
    else:
        scales = ("float32" if f.name == "int4" else "uint8", (stacked * rows, cols // f.block_cols))
    specs = {f"{name}{SEPARATOR}codes": ("uint8", codes), f"{name}{SEPARATOR}scales": scales}
    if f.name == "nvfp4":
        specs[f"{name}{SEPARATOR}tensor_scale"] = ("float32", (stacked,))
    return specs


def to_parts(name: str, tensor: Any, fmt: str) -> list[tuple[str, Any]]:
    from miles_engine.precision.quantizer import quantize

    return [(f"{name}{SEPARATOR}{part}", t) for part, t in quantize(tensor, fmt, name).parts().items()]


def quantized_from_parts(name: str, shape: tuple[int, ...], fmt: str, parts: Mapping[str, Any]) -> Any:
    """Weight ``name``'s :class:`~miles_engine.precision.quantizer.Quantized` from its parts, each
    checked against :func:`part_specs` (ValueError naming the part otherwise)."""
    from miles_engine.precision.quantizer import Quantized

    specs = part_specs(name, shape, fmt)
    for part, (want_dtype, want_shape) in specs.items():
        t = parts.get(part)
        if t is None:
            raise ValueError(f"{name!r} ({fmt}): part {part!r} is missing")
        got = str(t.dtype).removeprefix("torch.")
        if got != want_dtype or tuple(t.shape) != want_shape:
            raise ValueError(f"{part!r}: {got} {tuple(t.shape)}, {fmt} of {shape} needs {want_dtype} {want_shape}")
    return Quantized(fmt, tuple(shape), parts[f"{name}{SEPARATOR}codes"], parts[f"{name}{SEPARATOR}scales"],
                     parts.get(f"{name}{SEPARATOR}tensor_scale"))


def join(name: str, shape: tuple[int, ...], fmt: str, parts: Mapping[str, Any], dtype: Any) -> Any:
    """The weight's values (``dtype``) from its parts (:func:`quantized_from_parts`)."""
    from miles_engine.precision.quantizer import dequantize

    return dequantize(quantized_from_parts(name, shape, fmt, parts), dtype)

"""Tensors as a server holds them, for the clients that load them on a server's behalf (a restart's
restore, an update from memory) and for servers that take the fine-grained FP8 checkpoint's
names on the wire (SGLang): each weight held in a quantised format quantised from the trainer's
values (as a push ships it, :mod:`miles_engine.precision.parts`), the rest cast to the server's
dtype. Engines sit above the quantizer and below the weight transports, so this is the engines'
own copy of the transports' conform step (:func:`miles_engine.weights.tensors.conform`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from miles_engine.engines.errors import EngineRefusedUpdate
from miles_engine.engines.protocol import TensorMeta
from miles_engine.errors import did_you_mean


def held_tensors(weights: Mapping[str, Any], metadata: Sequence[TensorMeta], who: str) -> dict[str, Any]:
    """Each weight the server holds in a format as its codes and scales, floating point cast to the
    server's dtype; a name the server does not have is refused with nothing loaded."""
    import torch

    from miles_engine.precision.parts import to_parts

    meta = {m.name: m for m in metadata}
    out: dict[str, Any] = {}
    for name, t in weights.items():
        m = meta.get(name)
        if m is None and meta:
            raise EngineRefusedUpdate(f"{who}: the server has no tensor {name!r}{did_you_mean(name, meta)}; "
                                      f"nothing was loaded")
        if m is not None and m.format:
            out.update((n, p.contiguous()) for n, p in to_parts(name, t, m.format))
        elif m is not None and t.is_floating_point():
            out[name] = t.to(getattr(torch, m.dtype)).contiguous()
        else:
            out[name] = t.contiguous()
    return out


def fp8_checkpoint_tensors(parts: Mapping[str, Any], metadata: Sequence[TensorMeta]) -> dict[str, Any]:
    """:func:`held_tensors`' output under the fine-grained FP8 checkpoint's names: an FP8 weight as
    ``float8_e4m3fn`` in its own shape (the codes' bytes) and its ``weight_scale_inv``."""
    import torch

    from miles_engine.precision.checkpoint import fp8_wire_name

    shapes = {m.name: tuple(m.shape) for m in metadata}
    out: dict[str, Any] = {}
    for name, t in parts.items():
        wire, dtype = fp8_wire_name(name, str(t.dtype).removeprefix("torch."))
        if dtype == "float8_e4m3fn" and t.dtype == torch.uint8:
            t = t.view(torch.float8_e4m3fn).reshape(shapes.get(wire, tuple(t.shape)))
        out[wire] = t
    return out


def fp8_wire_specs(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                   metadata: Sequence[TensorMeta]) -> tuple[list[str], list[str], list[list[int]]]:
    """A bucket's names / dtypes / shapes as :func:`fp8_checkpoint_tensors` names them (the bytes
    on the wire are unchanged: an FP8 weight's codes are broadcast as they are)."""
    from miles_engine.precision.checkpoint import fp8_wire_name

    held = {m.name: list(m.shape) for m in metadata}
    out_names, out_dtypes, out_shapes = [], [], []
    for name, dtype, shape in zip(names, dtypes, shapes):
        wire, wire_dtype = fp8_wire_name(name, dtype)
        out_names.append(wire)
        out_dtypes.append(wire_dtype)
        out_shapes.append(held.get(wire, list(shape)) if wire_dtype == "float8_e4m3fn" else list(shape))
    return out_names, out_dtypes, out_shapes

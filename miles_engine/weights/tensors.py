"""Tensor plumbing shared by the transports and the engine-side receiver: dtype names, checking
and casting against an engine's metadata, flat byte buckets, per-tensor digests."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from miles_engine.engines.protocol import TensorMeta
from miles_engine.errors import did_you_mean
from miles_engine.models import adapters
from miles_engine.precision.parts import part_specs, split_name, to_parts
from miles_engine.weights.protocol import WeightPushError

ALIGN = 64  # byte alignment of every tensor inside a flat bucket (views need aligned offsets)
_SHOW = 5


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` -> ``torch.bfloat16`` (ValueError otherwise)."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


def nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


def conform(named: Iterable[tuple[str, torch.Tensor]], metadata: Sequence[TensorMeta],
            where: str) -> Iterable[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` detached, cast to the engine's dtype where both are floating point,
    and, for a tensor the engine holds in a quantised format, its codes and scales instead (the
    online export quantises here, once, on the trainer's side, the trainer's values before any cast:
    :mod:`miles_engine.precision.parts`);
    raise :class:`WeightPushError` on an unknown name, a shape or a non-castable dtype mismatch.
    With empty ``metadata`` (an engine that does not publish it) tensors pass unchanged."""
    meta = {m.name: m for m in metadata}
    for name, tensor in named:
        t = tensor.detach()
        lora = adapters.split_name(name)
        if lora is not None:  # an adapter part goes as it is: the engine merges it in float32
            _check_adapter_part(name, lora, t, meta, where)
            yield name, t
            continue
        m = meta.get(name)
        if m is None:
            if meta:
                raise WeightPushError(f"{where}: the engine has no tensor {name!r}{did_you_mean(name, meta)}; "
                                      f"nothing of this push was applied")
            yield name, t
            continue
        if tuple(t.shape) != tuple(m.shape):
            raise WeightPushError(f"{where}: {name!r} has shape {tuple(t.shape)}, the engine's is {tuple(m.shape)}")
        if m.format:  # quantised from the trainer's own values: the parts do not depend on the engine's dtype
            yield from to_parts(name, t, m.format)
            continue
        target = parse_dtype(m.dtype)
        if t.dtype != target:
            if not (t.dtype.is_floating_point and target.is_floating_point):
                raise WeightPushError(f"{where}: {name!r} is {dtype_name(t.dtype)}, the engine's is {m.dtype} "
                                      f"(only floating-point tensors are cast)")
            t = t.to(target)
        yield name, t


def weights_of(names: Iterable[str]) -> set[str]:
    """The engine weights that pushed ``names`` write: a quantised weight's or an adapter's parts
    count as the weight they update."""
    return {split[0] if (split := split_name(n) or adapters.split_name(n)) else n for n in names}


def _check_adapter_part(name: str, lora: tuple[str, str], t: torch.Tensor, meta: Mapping[str, TensorMeta],
                        where: str) -> None:
    if not meta:
        return
    m = meta.get(lora[0])
    if m is None:
        raise WeightPushError(f"{where}: the engine has no tensor {lora[0]!r}{did_you_mean(lora[0], meta)} for "
                              f"adapter part {name!r}; nothing of this push was applied")
    if m.format:
        raise WeightPushError(f"{where}: {lora[0]!r} is held in {m.format} by the engine; adapters merge into "
                              f"full-precision weights only (weights.lora=merged)")
    bad = adapters.part_problem(lora[0], tuple(m.shape), lora[1], dtype_name(t.dtype), tuple(t.shape))
    if bad is not None:
        raise WeightPushError(f"{where}: {bad}")


def check_received(incoming: Mapping[str, tuple[str, Sequence[int]]], metadata: Sequence[TensorMeta]) -> list[str]:
    """Problems of received (dtype, shape) against the engine's metadata (empty list = fine)."""
    meta = {m.name: m for m in metadata}
    problems = []
    for name, (dtype, shape) in incoming.items():
        lora = adapters.split_name(name)
        if lora is not None:
            m = meta.get(lora[0])
            if m is None:
                problems.append(f"unknown tensor {lora[0]!r}{did_you_mean(lora[0], meta)} for adapter part {name!r}")
            elif m.format:
                problems.append(f"{name!r}: {m.name!r} is held in {m.format} here; adapters merge into full "
                                f"precision only")
            elif (bad := adapters.part_problem(lora[0], tuple(m.shape), lora[1], dtype_name(parse_dtype(dtype)),
                                               tuple(shape))) is not None:
                problems.append(bad)
            continue
        part = split_name(name)
        m = meta.get(name if part is None else part[0])
        if part is not None and m is not None:
            want = part_specs(m.name, tuple(m.shape), m.format).get(name) if m.format else None
            if want is None:
                problems.append(f"{name!r}: {m.name!r} is not held in a quantised format here")
            elif (dtype_name(parse_dtype(dtype)), tuple(shape)) != (want[0], tuple(want[1])):
                problems.append(f"{name!r}: {dtype} {tuple(shape)}, {m.format} of {tuple(m.shape)} needs {want[0]} "
                                f"{tuple(want[1])}")
            continue
        if m is None:
            problems.append(f"unknown tensor {name!r}{did_you_mean(name, meta)}")
        elif tuple(shape) != tuple(m.shape):
            problems.append(f"{name!r}: shape {tuple(shape)}, model has {tuple(m.shape)}")
        elif dtype_name(parse_dtype(dtype)) != m.dtype:
            problems.append(f"{name!r}: dtype {dtype}, model has {m.dtype}")
    return problems[:_SHOW] + ([f"and {len(problems) - _SHOW} more"] if len(problems) > _SHOW else [])


def layout(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> tuple[list[tuple[int, int]], int]:
    """(offset, nbytes) of each tensor in a flat bucket, and the bucket's total size."""
    spans, off = [], 0
    for dtype, shape in zip(dtypes, shapes):
        size = nbytes(dtype, shape)
        spans.append((off, size))
        off += -(-size // ALIGN) * ALIGN
    return spans, off


def pack(tensors: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    spans, total = layout([t.dtype for t in tensors], [t.shape for t in tensors])
    buf = torch.zeros(total, dtype=torch.uint8, device=device)
    for t, (off, size) in zip(tensors, spans):
        if size:
            buf[off:off + size].copy_(t.to(device).contiguous().reshape(-1).view(torch.uint8))
    return buf


def unpack(buf: torch.Tensor, dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    spans, _ = layout(dtypes, shapes)
    out = []
    for dtype, shape, (off, size) in zip(dtypes, shapes, spans):
        out.append(buf[off:off + size].view(dtype).reshape(tuple(shape)) if size
                   else torch.empty(tuple(shape), dtype=dtype, device=buf.device))
    return out


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (compares tensors across processes)."""
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    h = hashlib.sha256(f"{dtype_name(t.dtype)}{tuple(t.shape)}".encode())
    h.update(data)
    return h.hexdigest()


def digests(named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
            names: Iterable[str] | None = None) -> dict[str, str]:
    items: Any = named.items() if isinstance(named, Mapping) else named
    wanted = None if names is None else set(names)
    return {n: digest(t) for n, t in items if wanted is None or n in wanted}

"""Tensor comparisons of the check (CPU, run in a worker thread) and the random pre-push fill."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from miles_engine.engines.protocol import TensorMeta
from miles_engine.precision.quantizer import dequantize, quantize
from miles_engine.weights.check.options import CheckTolerance
from miles_engine.weights.tensors import digest


@dataclass
class Mismatch:
    name: str
    problem: str  # "differs", "never written", "missing on the engine"
    max_abs_diff: float | None = None

    def describe(self) -> str:
        diff = "" if self.max_abs_diff is None else f", max abs diff {self.max_abs_diff:.6g}"
        if self.problem == "never written":
            return f"{self.name!r} was never written (still holds the pre-push random fill{diff})"
        return f"{self.name!r} {self.problem}{diff}"


def as_engine_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The trainer's tensor as a transport delivers it: floating point cast to the engine's dtype."""
    t = t.detach().to("cpu")
    if t.dtype != dtype and t.dtype.is_floating_point and dtype.is_floating_point:
        t = t.to(dtype)
    return t


def held_form(meta: TensorMeta) -> str:
    """How an engine holds a tensor: its dtype, ``+format`` when quantised (e.g. ``float32+fp8``)."""
    return f"{meta.dtype}+{meta.format}" if meta.format else meta.dtype


def form_dtype(form: str) -> torch.dtype:
    return getattr(torch, form.partition("+")[0])


def as_held(t: torch.Tensor, form: str, name: str) -> torch.Tensor:
    """The trainer's tensor as the engine holds it after a push: cast to the engine's dtype, or (a
    quantised engine) the quantizer's values of the trainer's tensor in the engine's dtype (the
    online export quantises before any cast: :func:`~miles_engine.weights.tensors.conform`)."""
    dtype, _, fmt = form.partition("+")
    if fmt:
        return dequantize(quantize(t.detach().to("cpu"), fmt, name), getattr(torch, dtype))
    return as_engine_dtype(t, getattr(torch, dtype))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(_bytes(a), _bytes(b))


def max_abs_diff(engine: torch.Tensor, trainer: torch.Tensor) -> float:
    """Largest |engine - trainer| in float64; NaN/inf where the other side differs count as inf."""
    if tuple(engine.shape) != tuple(trainer.shape):
        return math.inf
    if engine.numel() == 0:
        return 0.0
    a, b = engine.detach().to("cpu", torch.float64), trainer.detach().to("cpu", torch.float64)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))  # equal infs and NaN on both sides are no difference
    d = torch.where(same, torch.zeros_like(a), (a - b).abs())
    d = torch.nan_to_num(d, nan=math.inf)
    return float(d.max())


def within(engine: torch.Tensor, trainer: torch.Tensor, tol: CheckTolerance) -> bool:
    if tuple(engine.shape) != tuple(trainer.shape):
        return False
    a, b = engine.detach().to("cpu", torch.float64), trainer.detach().to("cpu", torch.float64)
    return bool(torch.isclose(a, b, rtol=tol.rtol, atol=tol.atol, equal_nan=True).all())


def compare(name: str, engine: torch.Tensor, trainer: torch.Tensor, exact: torch.Tensor,
            tolerance: CheckTolerance | None, fill_digest: str | None) -> Mismatch | None:
    """None when ``engine`` holds the trainer's tensor (exactly, or within ``tolerance``)."""
    if same_bytes(engine, exact):
        return None
    if tolerance is not None and within(engine, trainer, tolerance):
        return None
    diff = max_abs_diff(engine, trainer)
    if fill_digest is not None and digest(engine) == fill_digest:
        return Mismatch(name, "never written", diff)
    return Mismatch(name, "differs", diff)


def random_fill_as(dtype: torch.dtype, shape: tuple[int, ...], generator: torch.Generator,
                   avoid_digest: str | None) -> torch.Tensor:
    """Random data of ``dtype`` and ``shape`` whose digest is not ``avoid_digest`` (the trainer's
    tensor as the engine holds it, known by its digest only when it sits on trainer rank 0)."""
    fill = _random(dtype, tuple(shape), generator)
    if fill.numel() and avoid_digest is not None and digest(fill) == avoid_digest:  # a tiny tensor drew it: flip
        fill = ~fill if dtype == torch.bool else (_bytes(fill) ^ 0xFF).view(dtype).reshape(fill.shape).clone()
    return fill


def _random(dtype: torch.dtype, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        fill = torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
    elif dtype == torch.bool:
        fill = torch.randint(0, 2, shape, generator=generator).bool()
    elif dtype.is_complex:
        fill = torch.randn(shape, generator=generator, dtype=dtype)
    else:
        info = torch.iinfo(dtype)
        fill = torch.randint(max(info.min, -(1 << 31)), min(info.max, (1 << 31) - 1), shape,
                             generator=generator, dtype=torch.int64).to(dtype)
    return fill


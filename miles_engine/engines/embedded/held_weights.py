"""Quantised weights held in their format: an ``nn.Linear`` whose weight the rollout format applies
to (or a MoE layer's experts module, for its stacked experts) keeps the quantizer's codes and scales (:class:`~miles_engine.precision.quantizer.Quantized`)
instead of a full-precision parameter, and decodes them on each forward -- so the engine's weight
memory is the format's (an fp8 weight takes a quarter of float32's bytes plus its scales) and it
computes with exactly the values the quantizer defines (dequantise, then the float GEMM).

``weight_storage: values`` keeps the decoded values as well (decoded once per update: the float
path's speed, the same numbers, the codes kept beside them). The module keeps its name and its ``state_dict()``
(``weight`` is the decoded values), so metadata, checksums and weight checks read what they read
before. Updates go through :class:`HeldWeight`:
``copy_`` of full-precision values quantises them (once, on the engine), codes and scales joined
from an update's parts are stored as they came (the trainer quantised them; no second rounding).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from miles_engine.precision.quantizer import Quantized, dequantize, quantize


class HeldWeight:
    """The engine's handle on one held weight: shape and dtype as the full-precision one had."""

    def __init__(self, module: nn.Module, name: str, fmt: str, storage: str = "codes") -> None:
        attr = name.rpartition(".")[2]  # "weight", or an experts module's stacked parameter
        weight = getattr(module, attr)
        self.name, self.format, self.storage = name, fmt, storage
        self.shape, self.dtype = weight.shape, weight.dtype
        self.quantized: Quantized | None = None
        self._decoded: torch.Tensor | None = None
        self._store(quantize(weight.detach(), fmt, name))
        delattr(module, attr)  # the full-precision parameter goes; the module decodes ours instead
        held = {**getattr(module, "_held", {}), attr: self}
        module.__class__ = _held_class(getattr(module, "_held_base", type(module)), tuple(held))
        module._held_base = module.__class__.__mro__[1]  # type: ignore[assignment]
        module._held = held  # type: ignore[assignment]

    def _store(self, q: Quantized) -> None:
        self.quantized = q  # kept in both storages: what the engine holds, part for part (disk_delta's baseline)
        if self.storage == "values":  # decoded once, here: full-precision memory, no decode per forward
            self._decoded = dequantize(q, self.dtype)

    def values(self) -> torch.Tensor:
        if self._decoded is not None:
            return self._decoded
        assert self.quantized is not None
        return dequantize(self.quantized, self.dtype)

    def copy_(self, value: torch.Tensor | Quantized) -> HeldWeight:
        """New contents: codes and scales as given, or full-precision values quantised here."""
        if isinstance(value, Quantized):
            if value.format != self.format or tuple(value.shape) != tuple(self.shape):
                raise ValueError(f"{self.name}: {value.format} {value.shape} into {self.format} {tuple(self.shape)}")
            self._store(value)
        else:
            self._store(quantize(value.to(self.dtype), self.format, self.name))
        return self

    def detach(self) -> torch.Tensor:
        return self.values()

    @property
    def nbytes(self) -> int:
        assert self.quantized is not None
        decoded = 0 if self._decoded is None else self._decoded.numel() * self._decoded.element_size()
        return self.quantized.nbytes + decoded


_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _held_class(base: type, attrs: tuple[str, ...]) -> type:
    """``base`` whose parameters ``attrs`` are decoded from its :class:`HeldWeight` handles."""
    if (base, attrs) not in _CLASSES:
        def decoded(attr: str) -> property:
            return property(lambda self: self._held[attr].values())

        def save(self: Any, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
            for attr in attrs:  # first, where the parameters were
                destination[prefix + attr] = self._held[attr].values()
            base._save_to_state_dict(self, destination, prefix, keep_vars)

        _CLASSES[(base, attrs)] = type(f"Held{base.__name__}", (base,),
                                       {**{a: decoded(a) for a in attrs}, "_save_to_state_dict": save})
    return _CLASSES[(base, attrs)]


def hold(modules: dict[str, nn.Module], fmt: str, storage: str = "codes") -> dict[str, HeldWeight]:
    """Hold each ``{weight name: its nn.Linear}`` in ``fmt``; the handles by weight name."""
    return {name: HeldWeight(module, name, fmt, storage) for name, module in modules.items()}


def held_bytes(handles: dict[str, HeldWeight]) -> int:
    return sum(h.nbytes for h in handles.values())

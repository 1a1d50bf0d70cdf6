"""The rollout stage of the precision contract in the embedded engine: the quantised weights are
held in their format (:mod:`~miles_engine.engines.embedded.held_weights`: codes and scales, decoded
at each forward into exactly the values the quantizer defines) -- at load and after every update,
whatever the transport. An update may carry a weight in full precision (quantised here) or as its
codes and scales (the trainer quantised it once; stored as they came:
:mod:`miles_engine.precision.parts`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


from miles_engine.engines.embedded import weights as W
from miles_engine.engines.embedded.held_weights import HeldWeight, held_bytes, hold
from miles_engine.errors import ConfigError, WeightUpdateError
from miles_engine.precision.parts import quantized_from_parts, split_name
from miles_engine.precision.quantizer import QuantizeError
from miles_engine.precision.targets import quantized_weights


class HeldFormat:
    def __init__(self, model: Any, fmt: str, exceptions: tuple[str, ...], storage: str = "codes") -> None:
        self.format = fmt
        try:
            modules = {} if fmt == "full" else quantized_weights(model, fmt, exceptions)
        except QuantizeError as exc:
            raise ConfigError(f"engine weight_format={fmt}: {exc}") from None
        self.handles: dict[str, HeldWeight] = hold(modules, fmt, storage)
        self.names = frozenset(self.handles)

    def formats(self) -> dict[str, str]:
        return {n: self.format for n in self.names}

    def nbytes(self, model: Any) -> int:
        """The model's weight memory: held weights as stored, the rest as parameters and buffers."""
        tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}  # tied weights once
        return held_bytes(self.handles) + sum(t.numel() * t.element_size() for t in tensors.values())

    def incoming(self, weights: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
        """An update's tensors, checked against ``model``; a held weight's parts (``W:q.codes``, ...)
        become its :class:`~miles_engine.precision.quantizer.Quantized`, stored as it came."""
        plain: dict[str, Any] = {}
        parts: dict[str, dict[str, Any]] = {}
        for name, value in weights.items():
            split = split_name(name) if isinstance(name, str) else None
            if split is None:
                plain[name] = value
            else:
                parts.setdefault(split[0], {})[name] = value
        joined: dict[str, Any] = {}
        for base, group in parts.items():
            if base not in self.names:
                held = "in full precision" if base in model else "no such tensor"
                raise WeightUpdateError(f"weight update refused, nothing was changed: {base!r} arrives quantised "
                                        f"but this engine holds {held}")
            if base in plain:
                raise WeightUpdateError(f"weight update refused, nothing was changed: {base!r} arrives both whole "
                                        f"and as quantised parts")
            try:
                joined[base] = quantized_from_parts(base, tuple(model[base].shape), self.format, group)
            except ValueError as exc:
                raise WeightUpdateError(f"weight update refused, nothing was changed: {exc}") from None
        return {**(W.from_mapping(plain, model) if plain or not joined else {}), **joined}

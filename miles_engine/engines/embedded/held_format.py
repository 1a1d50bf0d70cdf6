"""The rollout stage of the precision contract in the embedded engine: the quantised weights hold
exactly the values the quantizer defines -- at load and after every update, whatever the transport.
An update may carry a weight in full precision (quantised here) or as its codes and scales (the
trainer quantised it once; joined here: :mod:`miles_engine.precision.parts`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from miles_engine.engines.embedded import weights as W
from miles_engine.errors import ConfigError, WeightUpdateError
from miles_engine.precision.parts import join, split_name
from miles_engine.precision.quantizer import QuantizeError, dequantize, quantize
from miles_engine.precision.targets import quantized_weights


class HeldFormat:
    def __init__(self, model: Any, fmt: str, exceptions: tuple[str, ...]) -> None:
        self.format = fmt
        try:
            self.names = frozenset() if fmt == "full" else frozenset(quantized_weights(model, fmt, exceptions))
        except QuantizeError as exc:
            raise ConfigError(f"engine weight_format={fmt}: {exc}") from None

    def formats(self) -> dict[str, str]:
        return {n: self.format for n in self.names}

    def snap(self, tensors: Mapping[str, Any], joined: frozenset[str] = frozenset()) -> dict[str, Any]:
        """Quantised weights -> the quantizer's values; ``joined`` ones hold them already."""
        if not self.names:
            return dict(tensors)
        return {n: dequantize(quantize(t, self.format, n), t.dtype) if n in self.names and n not in joined else t
                for n, t in tensors.items()}

    def incoming(self, weights: Mapping[str, Any], model: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An update's tensors, checked against ``model``, parts (``W:q.codes``, ...) joined into ``W``."""
        plain: dict[str, Any] = {}
        parts: dict[str, dict[str, Any]] = {}
        for name, value in weights.items():
            split = split_name(name) if isinstance(name, str) else None
            if split is None:
                plain[name] = value
            else:
                parts.setdefault(split[0], {})[name] = value
        for base, group in parts.items():
            if base not in self.names:
                held = "in full precision" if base in model else "no such tensor"
                raise WeightUpdateError(f"weight update refused, nothing was changed: {base!r} arrives quantised "
                                        f"but this engine holds {held}")
            ref = model[base]
            try:
                plain[base] = join(base, tuple(ref.shape), self.format, group, ref.dtype)
            except ValueError as exc:
                raise WeightUpdateError(f"weight update refused, nothing was changed: {exc}") from None
        return self.snap(W.from_mapping(plain, model), frozenset(parts))

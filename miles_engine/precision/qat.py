"""The trainer's stage of the contract: quantisation-aware training. Each quantised ``nn.Linear``
computes with ``fake_quantize(weight)`` -- exactly the values the engine holds -- and its gradient
reaches the full-precision master weight unchanged (straight-through). Parameter names, the
state dict and the optimizer are untouched."""

from __future__ import annotations

from collections.abc import Iterable
from types import MethodType
from typing import Any

from miles_engine.precision.quantizer import fake_quantize
from miles_engine.precision.targets import quantized_weights


def apply(model: Any, fmt: str, exceptions: Iterable[str] = ()) -> list[str]:
    """Fake-quantise the forward of every weight :func:`quantized_weights` picks; returns their names."""
    import torch.nn.functional as F

    chosen = quantized_weights(model, fmt, exceptions)

    def forward(self: Any, x: Any) -> Any:
        weight = fake_quantize(self.weight, fmt, self.qat_name) if self.qat_active else self.weight
        return F.linear(x, weight, self.bias)

    for name, module in chosen.items():
        module.qat_name, module.qat_active = name, True
        module.forward = MethodType(forward, module)
    return sorted(chosen)

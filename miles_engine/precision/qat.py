"""The trainer's stage of the contract: quantisation-aware training. Each quantised ``nn.Linear``
computes with ``fake_quantize(weight)`` -- exactly the values the engine holds -- and its gradient
reaches the full-precision master weight unchanged (straight-through); a MoE layer's stacked
experts compute with theirs (the module sees the fake-quantised tensors in its parameters' place
for the length of its forward). Parameter names, the state dict and the optimizer are untouched."""

from __future__ import annotations

from collections.abc import Iterable
from types import MethodType
from typing import Any

from miles_engine.precision.quantizer import fake_quantize
from miles_engine.precision.targets import is_stacked, quantized_weights


def apply(model: Any, fmt: str, exceptions: Iterable[str] = ()) -> list[str]:
    """Fake-quantise the forward of every weight :func:`quantized_weights` picks; returns their names."""
    import torch.nn.functional as F

    chosen = quantized_weights(model, fmt, exceptions)

    def forward(self: Any, x: Any) -> Any:
        weight = fake_quantize(self.weight, fmt, self.qat_name) if self.qat_active else self.weight
        return F.linear(x, weight, self.bias)

    stacks: dict[int, tuple[Any, dict[str, str]]] = {}
    for name, module in chosen.items():
        if is_stacked(name):
            stacks.setdefault(id(module), (module, {}))[1][name.rpartition(".")[2]] = name
            continue
        module.qat_name, module.qat_active = name, True
        module.forward = MethodType(forward, module)
    for module, attrs in stacks.values():
        _quantise_stacked(module, attrs, fmt)
    return sorted(chosen)


def _quantise_stacked(module: Any, attrs: dict[str, str], fmt: str) -> None:
    """``module``'s forward computes with the fake-quantised ``attrs`` (parameter -> weight name)."""
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not module.qat_active:
            return inner(*args, **kwargs)
        params = module._parameters
        saved = {attr: params[attr] for attr in attrs}
        try:
            for attr, name in attrs.items():  # a tensor in the parameter's slot: autograd reaches the parameter
                params[attr] = fake_quantize(saved[attr], fmt, name)
            return inner(*args, **kwargs)
        finally:
            params.update(saved)

    module.qat_name, module.qat_active = ", ".join(attrs.values()), True
    module.forward = forward

"""Which weights a format applies to, decided the same way in every stage: the weight of every
``nn.Linear`` except the output head (embeddings, norms, biases and the head stay in high
precision), minus the contract's exceptions. Trainer and engine hold the same Hugging Face
model, so they find the same names."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase
from typing import Any

from miles_engine.precision.formats import get_format


def is_exception(name: str, exceptions: Iterable[str]) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in exceptions)


def quantized_weights(model: Any, fmt: str, exceptions: Iterable[str] = ()) -> dict[str, Any]:
    """``{weight name: its nn.Linear}`` that ``fmt`` applies to; a weight the format cannot hold
    (last dimension off the block) is one error naming it and the way out (an exception)."""
    from torch import nn

    from miles_engine.precision.quantizer import QuantizeError

    f = get_format(fmt)
    exceptions = tuple(exceptions)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    chosen, misfits = {}, []
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is head:
            continue
        name = f"{module_name}.weight"
        if is_exception(name, exceptions):
            continue
        if f.block_rows == 1 and module.weight.shape[-1] % f.block_cols:
            misfits.append(f"{name} {tuple(module.weight.shape)}")
            continue
        chosen[name] = module
    if misfits:
        raise QuantizeError(f"{fmt} needs the last dimension of every quantised weight to be a multiple of "
                            f"{f.block_cols}; these are not: {', '.join(misfits[:5])}"
                            f"{f' and {len(misfits) - 5} more' if len(misfits) > 5 else ''}. Keep them in high "
                            f"precision: precision.exceptions in a recipe, --exception of miles convert (fnmatch "
                            f"patterns of weight names)")
    return chosen

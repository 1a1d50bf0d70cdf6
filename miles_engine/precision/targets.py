"""Which weights a format applies to, decided the same way in every stage: the weight of every
``nn.Linear`` except the output head, and a MoE layer's stacked experts (Hugging Face holds them as
``[experts, out, in]`` parameters of its ``experts`` module: each expert quantised as its own
weight) -- embeddings, norms, biases, routers and the head stay in high precision -- minus the
contract's exceptions. Trainer and engine hold the same Hugging Face model, so they find the same
names."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase
from typing import Any

from miles_engine.precision.formats import get_format


def is_exception(name: str, exceptions: Iterable[str]) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in exceptions)


def quantized_weights(model: Any, fmt: str, exceptions: Iterable[str] = ()) -> dict[str, Any]:
    """``{weight name: the module holding it}`` that ``fmt`` applies to (an ``nn.Linear``'s
    ``weight``, an experts module's stacked parameter: :func:`weight_of`); a weight the format
    cannot hold (last dimension off the block) is one error naming it and the way out (an exception)."""
    from torch import nn

    exceptions = tuple(exceptions)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    chosen = {}
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not head:
            chosen[f"{module_name}.weight"] = module
        elif module_name.rpartition(".")[2] == "experts":
            chosen.update((f"{module_name}.{attr}", module) for attr, p in module.named_parameters(recurse=False)
                          if p.dim() >= 3)
    chosen = {n: m for n, m in chosen.items() if not is_exception(n, exceptions)}
    check_fits({n: tuple(weight_of(m, n).shape) for n, m in chosen.items()}, fmt)
    return chosen


def weight_of(module: Any, name: str) -> Any:
    """The parameter ``name`` (a weight's full name) of its ``module``."""
    return getattr(module, name.rpartition(".")[2])


def is_stacked(name: str) -> bool:
    """A MoE layer's stacked experts (not an ``nn.Linear``'s weight)."""
    return not name.endswith(".weight")


def check_fits(shapes: Mapping[str, tuple[int, ...]], fmt: str) -> None:
    """One error naming every weight ``fmt`` cannot hold (last dimension off the block) and the way
    out (an exception)."""
    from miles_engine.precision.quantizer import QuantizeError

    f = get_format(fmt)
    misfits = [f"{name} {tuple(shape)}" for name, shape in shapes.items()
               if f.block_rows == 1 and shape[-1] % f.block_cols]
    if misfits:
        raise QuantizeError(f"{fmt} needs the last dimension of every quantised weight to be a multiple of "
                            f"{f.block_cols}; these are not: {', '.join(misfits[:5])}"
                            f"{f' and {len(misfits) - 5} more' if len(misfits) > 5 else ''}. Keep them in high "
                            f"precision: precision.exceptions in a recipe, --exception of miles convert (fnmatch "
                            f"patterns of weight names)")

"""Which class of tensors a train-rollout log-prob gap comes from: for each class (the weight name
without its layer and expert indices, e.g. ``layers.mlp.down_proj``), the trainer's log-probs of
the same tokens with only that class quantised, against full precision. The class that moves
them most is the one to keep in high precision (``precision.exceptions``)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from miles_engine.precision.quantizer import dequantize, quantize
from miles_engine.precision.targets import quantized_weights, weight_of

_INDEX = re.compile(r"\.\d+(?=\.)")


def tensor_class(name: str) -> str:
    """``model.layers.3.mlp.experts.7.up_proj.weight`` -> ``layers.mlp.experts.up_proj``."""
    return _INDEX.sub("", name).removeprefix("model.").removesuffix(".weight")


@contextmanager
def full_precision_forward(model: Any) -> Iterator[None]:
    """Quantisation-aware modules (``qat.apply``) compute with their full-precision weights inside."""
    modules = [m for m in model.modules() if hasattr(m, "qat_name")]
    for m in modules:
        m.qat_active = False
    try:
        yield
    finally:
        for m in modules:
            m.qat_active = True


def _token_logprobs(model: Any, rows: Sequence[tuple[list[int], list[int]]]) -> list[Any]:
    import torch

    device = next(model.parameters()).device
    out = []
    for ids, mask in rows:
        x = torch.tensor([ids], device=device)
        logits = model(input_ids=x).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(1, x[0, 1:, None])[:, 0]
        keep = torch.tensor(mask[1:], device=device, dtype=torch.bool)
        out.append(logp[keep].double())
    return out


def class_gaps(model: Any, rows: Sequence[tuple[list[int], list[int]]], fmt: str,
               exceptions: Sequence[str] = ()) -> dict[str, float]:
    """``{tensor class: mean |log p(only that class in fmt) - log p(full)|}`` over the masked
    tokens of ``rows`` (token ids, loss mask), largest first. The model is left as it was."""
    import torch

    by_class: dict[str, dict[str, Any]] = {}
    for name, module in quantized_weights(model, fmt, exceptions).items():
        by_class.setdefault(tensor_class(name), {})[name] = module
    gaps = {}
    with torch.no_grad(), full_precision_forward(model):
        base = _token_logprobs(model, rows)
        n = sum(len(b) for b in base) or 1
        for cls, modules in by_class.items():
            weights = {name: weight_of(m, name).data for name, m in modules.items()}
            saved = {name: w.clone() for name, w in weights.items()}
            try:
                for name, w in weights.items():
                    w.copy_(dequantize(quantize(w, fmt, name), w.dtype))
                moved = _token_logprobs(model, rows)
            finally:
                for name, w in weights.items():
                    w.copy_(saved[name])
            gaps[cls] = float(sum((a - b).abs().sum() for a, b in zip(moved, base)) / n)
    return dict(sorted(gaps.items(), key=lambda kv: -kv[1]))

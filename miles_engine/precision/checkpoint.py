"""The first stage of the contract: a model directory in a quantised format, written from full
precision weights and read back into exactly the quantizer's values.

- ``fp8`` is written in Hugging Face's fine-grained FP8 layout, which vLLM and SGLang load as is
  (DeepSeek-V3, Qwen3-FP8): the weight as ``float8_e4m3fn``, ``<module>.weight_scale_inv`` the
  float32 scale of each 128x128 tile (multiplied in, despite its name), and
  ``quantization_config = {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128], ...}``.
- the other formats have no common layout: the weight travels as its parts (``W:q.codes``,
  ``W:q.scales``, ``W:q.tensor_scale``, :mod:`miles_engine.precision.parts`) under
  ``quantization_config = {quant_method: miles, format: ..., exceptions: [...]}``.
Either way ``quantization_config.miles`` records the format and the exception list, so loading
knows which contract the directory was written under.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from miles_engine.precision.formats import get_format
from miles_engine.precision.parts import join, split_name, to_parts

SCALE_SUFFIX = "weight_scale_inv"


def quantization_config(fmt: str, exceptions: Iterable[str], names: Iterable[str],
                        linear_modules: Iterable[str] = ()) -> dict[str, Any]:
    """``names``: the quantised weights; ``linear_modules``: every linear layer's module name, so the
    ones kept in high precision (exceptions, the output head) are listed where Hugging Face and vLLM
    read them (``modules_to_not_convert``): without it they would take those layers for FP8 too."""
    get_format(fmt)
    record = {"format": fmt, "exceptions": list(exceptions), "quantized": sorted(names)}
    quantised_modules = {n.removesuffix(".weight") for n in record["quantized"]}
    kept = sorted(set(linear_modules) - quantised_modules)
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": kept, "miles": record}
    return {"quant_method": "miles", "miles": record}


def save_quantized(model: Any, dest: Path, fmt: str, exceptions: Iterable[str] = ()) -> None:
    """``model`` (a Hugging Face model) as a directory in ``fmt``: its config with the
    ``quantization_config`` above, one safetensors file; a weight the format cannot hold is one
    ConfigError naming it."""
    from safetensors.torch import save_file
    from torch import nn

    from miles_engine.errors import ConfigError
    from miles_engine.precision.quantizer import QuantizeError
    from miles_engine.precision.targets import quantized_weights

    exceptions = list(exceptions)
    try:
        names = quantized_weights(model, fmt, exceptions)
    except QuantizeError as exc:
        raise ConfigError(str(exc)) from None
    state = dict(model.state_dict())
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the embeddings' storage, saved once
    dest.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(str(dest))
    config = json.loads((dest / "config.json").read_text())
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    config["quantization_config"] = quantization_config(fmt, exceptions, names, linear)
    # save_pretrained records the class; config.save_pretrained alone does not (vLLM would guess a pooling model)
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file(to_checkpoint(state, names, fmt), str(dest / "model.safetensors"), metadata={"format": "pt"})


def contract_of(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """``{format, exceptions, quantized}`` of a directory's config (None: full precision); a
    quantised layout we cannot read is one error naming it."""
    q = config.get("quantization_config")
    if not q:
        return None
    record = q.get("miles") if isinstance(q, Mapping) else None
    if record is None:
        raise ValueError(f"quantization_config {dict(q) if isinstance(q, Mapping) else q!r} was not written by "
                         f"miles (quant_method {q.get('quant_method') if isinstance(q, Mapping) else None!r}); "
                         f"load the full-precision checkpoint, or convert it with `miles convert`")
    get_format(record["format"])
    return dict(record)


def to_checkpoint(state: Mapping[str, Any], names: Iterable[str], fmt: str) -> dict[str, Any]:
    """The tensors to save: ``names`` quantised in ``fmt``, the rest as they are."""
    import torch

    from miles_engine.precision.quantizer import quantize

    names = set(names)
    out: dict[str, Any] = {}
    for name, tensor in state.items():
        if name not in names:
            out[name] = tensor.contiguous()
        elif fmt == "fp8":
            q = quantize(tensor, fmt, name)
            out[name] = q.codes.view(torch.float8_e4m3fn).reshape(tensor.shape).contiguous()
            out[scale_name(name)] = q.scales.contiguous()
        else:
            out.update((n, t.contiguous()) for n, t in to_parts(name, tensor, fmt))
    return out


def scale_name(weight: str) -> str:
    """The fine-grained FP8 layout's name of weight ``weight``'s tile scales (``X.weight`` ->
    ``X.weight_scale_inv``; a MoE layer's stacked ``X.gate_up_proj`` -> ``X.gate_up_proj_scale_inv``)."""
    return f"{weight.removesuffix('weight')}{SCALE_SUFFIX}" if weight.endswith(".weight") else f"{weight}_scale_inv"


def fp8_wire_name(name: str, dtype: str) -> tuple[str, str]:
    """A pushed tensor's name and dtype as a server that loads the fine-grained FP8 layout receives
    it (SGLang's ``/update_weights_from_distributed`` feeds them to the model's ``load_weights``):
    an FP8 weight's codes are the weight itself, ``float8_e4m3fn`` (the same bytes); its scales
    ``<module>.weight_scale_inv``; anything else unchanged. Other formats have no such layout."""
    split = split_name(name)
    if split is None:
        return name, dtype
    weight, part = split
    if part == "codes":
        return weight, "float8_e4m3fn"
    if part == "scales":
        return scale_name(weight), dtype
    raise ValueError(f"{name!r}: only fp8 weights (codes + scales) have a fine-grained FP8 checkpoint name")


def from_checkpoint(saved: Mapping[str, Any], contract: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
                    dtype: Any) -> dict[str, Any]:
    """The model's tensors (``dtype``) from a quantised directory's, the quantised ones holding
    exactly the quantizer's values. ``shapes``: the model's, by name."""
    import torch

    from miles_engine.precision.quantizer import Quantized, dequantize

    fmt, quantized = contract["format"], set(contract["quantized"])
    out: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for name, tensor in saved.items():
        split = split_name(name)
        if split is not None:
            parts.setdefault(split[0], {})[name] = tensor
        elif name.endswith("_scale_inv"):  # read with its weight
            continue
        elif name in quantized and fmt == "fp8":
            scales = saved.get(scale_name(name))
            if scales is None:
                raise ValueError(f"{name!r} is fp8 but its {SCALE_SUFFIX} is missing")
            codes = tensor.view(torch.uint8).reshape(-1, tensor.shape[-1])
            out[name] = dequantize(Quantized("fp8", tuple(tensor.shape), codes, scales.float()), dtype)
        else:
            out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    for name, group in parts.items():
        if name not in shapes:
            raise ValueError(f"{next(iter(group))!r}: the model has no weight {name!r}")
        out[name] = join(name, tuple(shapes[name]), fmt, group, dtype)
    missing = sorted(quantized - set(out))
    if missing:
        raise ValueError(f"quantised weights missing from the directory: {missing[:5]}")
    return out

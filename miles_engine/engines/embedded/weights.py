"""Weight metadata, validation and in-place loading for the embedded engine.

Names are the model's ``state_dict()`` names (Hugging Face layout; tied weights appear under
each of their names and share storage). An update may carry any subset of them; every tensor
is checked for name, shape and dtype *before* anything is copied, so a bad update changes
nothing (:class:`WeightUpdateError` lists the first mismatches).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from miles_engine.engines.protocol import TensorMeta
from miles_engine.errors import WeightUpdateError, did_you_mean

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_SHOW = 5


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def model_tensors(model: Any) -> dict[str, torch.Tensor]:
    """Name -> the live tensor (shares storage with the model; ``copy_`` into it updates the model)."""
    return dict(model.state_dict(keep_vars=False))


def metadata(tensors: Mapping[str, torch.Tensor], formats: Mapping[str, str] | None = None) -> list[TensorMeta]:
    formats = formats or {}
    return [TensorMeta(name, dtype_name(t.dtype), tuple(t.shape), formats.get(name)) for name, t in tensors.items()]


def check(incoming: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
          model: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise :class:`WeightUpdateError` unless every incoming (dtype, shape) matches the model."""
    if not incoming:
        raise WeightUpdateError(f"weight update from {source} has no tensors")
    problems: list[str] = []
    for name, (dtype, shape) in incoming.items():
        ref = model.get(name)
        if ref is None:
            problems.append(f"unknown tensor {name!r}{did_you_mean(name, model)}")
        elif tuple(shape) != tuple(ref.shape):
            problems.append(f"{name!r}: shape {tuple(shape)}, model has {tuple(ref.shape)}")
        elif dtype != ref.dtype:
            problems.append(f"{name!r}: dtype {dtype_name(dtype)}, model has {dtype_name(ref.dtype)}")
    if problems:
        more = f" (and {len(problems) - _SHOW} more)" if len(problems) > _SHOW else ""
        raise WeightUpdateError(
            f"weight update from {source} refused, nothing was changed: {len(problems)} of {len(incoming)} "
            f"tensors do not match the model: " + "; ".join(problems[:_SHOW]) + more)


def from_mapping(weights: Mapping[str, Any], model: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name, value in weights.items():
        if not isinstance(name, str):
            raise WeightUpdateError(f"weight names must be strings, got {name!r}")
        tensors[name] = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    check({n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, model, "tensors")
    return tensors


def safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise WeightUpdateError(f"weight path {path} does not exist")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"no *.safetensors files in {path}")
    return files


def from_safetensors(path: Path, model: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Validate the headers of every file first, then read the tensors (CPU)."""
    from safetensors import safe_open

    files = safetensors_files(Path(path))
    header: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                sl = handle.get_slice(name)
                raw = sl.get_dtype()
                dtype = _ST_DTYPES.get(raw)
                if dtype is None:
                    raise WeightUpdateError(f"{f.name}: tensor {name!r} has unsupported dtype {raw}")
                if name in where:
                    raise WeightUpdateError(f"tensor {name!r} appears in both {where[name].name} and {f.name}")
                header[name] = (dtype, tuple(sl.get_shape()))
                where[name] = f
    check(header, model, str(path))
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


def apply(tensors: Mapping[str, torch.Tensor], model: Mapping[str, torch.Tensor]) -> None:
    """Copy validated tensors into the model (call between forward passes)."""
    with torch.no_grad():
        for name, value in tensors.items():
            model[name].copy_(value)

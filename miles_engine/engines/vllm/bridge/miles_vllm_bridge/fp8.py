"""FP8 weights of a vLLM model loaded from a fine-grained FP8 checkpoint (the precision
contract's ``fp8``: E4M3 codes, a float32 scale per 128x128 tile, multiplied in), in the trainer's
names and back:

- **held**: which Hugging Face weights vLLM holds in FP8 -- each part of a packed layer
  (``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``) by the layer's ``output_sizes``; a packed
  layer whose parts do not start on a tile row cannot be split (its tiles straddle two weights)
  and is one error naming it (the kind refuses such a contract before starting vLLM);
- **receiving**: the online export ships ``W:q.codes`` (uint8) and ``W:q.scales`` (float32);
  they load as ``W`` (``float8_e4m3fn``) and ``W_scale_inv``, the checkpoint's names, through the
  model's own ``load_weights``;
- **reading back**: vLLM's CPU kernel re-packs an FP8 weight for AMX (a permutation of its bytes,
  ``convert_weight_packed``); the inverse permutation is found once per shape by packing index
  probes through the same op, so read-back returns the codes the kernel computes with, decoded as
  ``miles_engine.precision.quantizer.dequantize`` does (float32 product, cast to the model's dtype).

Kept in step by hand with ``miles_engine/precision/parts.py`` (part names and shapes): vLLM's
environment has no miles_engine to import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

SEPARATOR = ":q."
TILE = 128
SCALE_SUFFIX = "weight_scale_inv"


@dataclass(frozen=True)
class HeldFp8:
    """One Hugging Face weight vLLM holds in FP8: rows ``start:start + rows`` of ``module``."""

    module: str  # the vLLM module's name (``...qkv_proj``)
    start: int
    rows: int
    cols: int


def _packed_weight(layer: torch.nn.Module) -> bool:
    kernel = getattr(getattr(layer, "quant_method", None), "fp8_linear", None)
    return type(kernel).__name__ == "CPUFp8BlockScaledMMKernel" and not getattr(layer, "_cpu_skip_gemm_dispatch",
                                                                                False)


def held_fp8(model: torch.nn.Module) -> dict[str, HeldFp8]:
    """``{trainer weight name: where vLLM holds it}`` for every FP8 weight of the model."""
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    out: dict[str, HeldFp8] = {}
    for module_name, module in model.named_modules():
        weight, scale = getattr(module, "weight", None), getattr(module, SCALE_SUFFIX, None)
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float8_e4m3fn or scale is None:
            continue
        rows, cols = weight.shape
        owner, _, leaf = module_name.rpartition(".")
        parts = packed.get(leaf)
        if not parts:
            out[f"{module_name}.weight"] = HeldFp8(module_name, 0, rows, cols)
            continue
        sizes = list(getattr(module, "output_sizes", []) or [])
        if len(sizes) != len(parts) or sum(sizes) != rows:
            raise RuntimeError(f"cannot split {module_name}.weight {tuple(weight.shape)} into {parts} (output_sizes "
                               f"{sizes}): read-back needs tensor-parallel size 1")
        start = 0
        for part, size in zip(parts, sizes):
            name = f"{owner}.{part}.weight" if owner else f"{part}.weight"
            if start % TILE:
                raise RuntimeError(f"{module_name} packs {parts} ({sizes} rows) and {name} starts at row {start}, "
                                   f"inside a {TILE}-row scale tile of the packed weight: its FP8 scales are not its "
                                   f"own. Keep these weights in high precision (precision.exceptions)")
            out[name] = HeldFp8(module_name, start, size, cols)
            start += size
    return out


def metadata(held: dict[str, HeldFp8], dtype: torch.dtype) -> list[list[Any]]:
    """``[name, dtype, shape, "fp8"]`` of each FP8 weight, as the trainer sees it."""
    dtype_name = str(dtype).removeprefix("torch.")
    return [[n, dtype_name, [h.rows, h.cols], "fp8"] for n, h in held.items()]


def to_checkpoint_names(named: Any, held: dict[str, HeldFp8]) -> list[tuple[str, torch.Tensor]]:
    """The online export's tensors under the checkpoint's names: ``W:q.codes`` -> ``W`` (FP8),
    ``W:q.scales`` -> ``W_scale_inv``; ValueError for a weight held in FP8 sent in full precision or
    a part of another format."""
    out = []
    for name, tensor in named:
        base, sep, part = name.rpartition(SEPARATOR)
        if not sep:
            if name in held:
                raise ValueError(f"{name!r} is held in fp8 by this server: send its parts ({name}{SEPARATOR}codes, "
                                 f"{name}{SEPARATOR}scales), not a {str(tensor.dtype).removeprefix('torch.')} tensor")
            out.append((name, tensor))
        elif base not in held:
            raise ValueError(f"{name!r}: {base!r} is not held in fp8 by this server")
        elif part == "codes":
            out.append((base, tensor.view(torch.float8_e4m3fn)))
        elif part == "scales":
            out.append((f"{base.removesuffix('weight')}{SCALE_SUFFIX}", tensor))
        else:
            raise ValueError(f"{name!r}: part {part!r} belongs to another format than fp8")
    return out


@lru_cache(maxsize=64)
def _source_index(shape: tuple[int, int]) -> torch.Tensor:
    """For each byte of a packed weight, where it was before packing: packs base-127 digits of the
    element index (codes 0..126, never NaN) and reads them back."""
    numel = math.prod(shape)
    index = torch.arange(numel, dtype=torch.int64)
    source = torch.zeros(numel, dtype=torch.int64)
    place = 1
    while place < numel:
        digit = ((index // place) % 127).to(torch.uint8).reshape(shape)
        packed = torch.ops._C.convert_weight_packed(digit.view(torch.float8_e4m3fn))
        source += packed.contiguous().view(torch.uint8).reshape(-1).to(torch.int64) * place
        place *= 127
    if not torch.equal(torch.sort(source).values, index):
        raise RuntimeError(f"vLLM's packing of a {shape} FP8 weight is not a permutation of its bytes: cannot read "
                           f"it back")
    return source


def codes_of(layer: torch.nn.Module) -> torch.Tensor:
    """The layer's FP8 codes (uint8, rows x cols) as the checkpoint laid them out."""
    weight = layer.weight.detach().to("cpu").contiguous()
    flat = weight.view(torch.uint8).reshape(-1)
    if not _packed_weight(layer):
        return flat.reshape(weight.shape)
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    out = torch.empty_like(flat)
    out[_source_index(shape)] = flat
    return out.reshape(shape)


def decoded(model: torch.nn.Module, held: HeldFp8, dtype: torch.dtype) -> torch.Tensor:
    """The weight's values: E4M3 codes times their tile's scale in float32, cast to ``dtype``."""
    layer = model.get_submodule(held.module)
    codes = codes_of(layer).narrow(0, held.start, held.rows)
    scale = getattr(layer, SCALE_SUFFIX).detach().to("cpu", torch.float32)
    first = held.start // TILE
    tiles = scale.narrow(0, first, math.ceil(held.rows / TILE))
    expanded = tiles.repeat_interleave(TILE, 0)[: held.rows].repeat_interleave(TILE, 1)[:, : held.cols]
    return (codes.view(torch.float8_e4m3fn).to(torch.float32) * expanded).to(dtype)

"""Read an engine's tensors back for the check, wherever the engine runs.

- in-process engines (``engine.model``): the live tensors, compared directly;
- our HTTP server (a separate process): per-tensor sha256 computed engine-side
  (``POST /miles/weight_checksums``), so a passing check moves 64 hex chars per tensor instead
  of the model; only tensors whose checksum differs are fetched (``/get_weights_by_name``) to
  measure their max abs diff or to apply the tolerance;
- any other SGLang-compatible server: every tensor through SGLang's ``/get_weights_by_name``
  (float32 values as JSON: slow on big models, exact for float32 / bfloat16 / float16).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from miles_engine.engines.protocol import TensorMeta, served_tensors
from miles_engine.weights.check.errors import WeightCheckError
from miles_engine.weights.protocol import engine_name

__all__ = ["EngineReader", "RemoteReader", "WeightCheckError", "reader_for"]


class EngineReader:
    """How the check reads one engine. ``digests`` is None when the engine cannot hash its own
    tensors; ``tensors`` returns values in the engine's dtype (missing names are left out)."""

    kind = "in_process"

    def __init__(self, engine: Any, name: str) -> None:
        self.engine, self.name = engine, name
        self.unreadable: dict[str, str] = {}  # name -> why it could not be read back

    async def digests(self, names: Sequence[str]) -> dict[str, str] | None:
        return None

    async def tensors(self, names: Sequence[str], meta: Mapping[str, TensorMeta]) -> dict[str, torch.Tensor]:
        live = served_tensors(self.engine, names) or {}
        return {n: t.detach() for n, t in live.items()}


class RemoteReader(EngineReader):
    def __init__(self, engine: Any, name: str, *, checksums: bool) -> None:
        super().__init__(engine, name)
        self.checksums = checksums
        self.kind = "checksums" if checksums else "get_weights_by_name"
        self._meta: Mapping[str, TensorMeta] = {}

    async def digests(self, names: Sequence[str]) -> dict[str, str] | None:
        if not self.checksums:
            return None
        return await self.engine.weight_checksums(list(names))

    async def _fetch(self, name: str, meta: TensorMeta | None) -> torch.Tensor:
        if meta is not None and meta.format:
            return await self._fetch_fp8(name, meta)
        return await self._fetch_values(name, meta)

    async def _fetch_fp8(self, name: str, meta: TensorMeta) -> torch.Tensor:
        """An FP8 weight of a server holding the fine-grained FP8 layout (SGLang): the weight's
        codes (float8 values, exact as float32) and its ``weight_scale_inv``, decoded as the
        quantizer decodes them, in the engine's dtype."""
        from miles_engine.engines.fp8_checkpoint import fused_scale_rows
        from miles_engine.precision.checkpoint import scale_name
        from miles_engine.precision.parts import part_specs
        from miles_engine.precision.quantizer import Quantized, dequantize

        if meta.format != "fp8":
            raise WeightCheckError(f"{self.name} holds {name!r} in {meta.format}, which /get_weights_by_name cannot "
                                   f"read back (only the fine-grained FP8 layout has checkpoint names)")
        shape = tuple(meta.shape)
        scale_shape = next(s for n, (_, s) in part_specs(name, shape, "fp8").items() if n.endswith("scales"))
        codes = await self._fetch_values(name, TensorMeta(name, "float32", shape))
        fused = fused_scale_rows(name, {n: tuple(m.shape) for n, m in self._meta.items()})
        if fused is None:
            scales = await self._fetch_values(scale_name(name), TensorMeta(scale_name(name), "float32", scale_shape))
        else:  # SGLang reads a fused part's rows out of the fused parameter, which its scales do not follow
            fused_name, first, rows, total = fused
            stacked = await self._fetch_values(fused_name, TensorMeta(fused_name, "float32", (total, scale_shape[-1])))
            scales = stacked[first:first + rows]
        codes = codes.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1, shape[-1])
        return dequantize(Quantized("fp8", shape, codes, scales), getattr(torch, meta.dtype))

    async def _fetch_values(self, name: str, meta: TensorMeta | None) -> torch.Tensor:
        shape = tuple(meta.shape) if meta is not None else None
        rows = shape[0] if shape else 1
        data = await self.engine.get_weights_by_name(name, truncate_size=max(int(rows), 1))
        if data is None:
            raise WeightCheckError(f"{self.name} returned nothing for tensor {name!r} (/get_weights_by_name)")
        try:
            values = torch.tensor(data, dtype=torch.float32)
        except (TypeError, ValueError):  # SGLang's orjson sends NaN / inf as null
            values = torch.tensor(_nulls_to_nan(data), dtype=torch.float32)
        if shape is None:
            return values
        numel = 1
        for d in shape:
            numel *= int(d)
        if values.numel() != numel:
            raise WeightCheckError(f"{self.name} /get_weights_by_name returned {values.numel()} values for "
                                   f"{name!r}, its shape {shape} holds {numel} (a data-parallel server answers one "
                                   f"copy per replica: check each replica's own URL)")
        dtype = getattr(torch, meta.dtype, torch.float32) if meta is not None else torch.float32
        return values.reshape(shape).to(dtype)

    async def tensors(self, names: Sequence[str], meta: Mapping[str, TensorMeta]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        self._meta = meta
        for name in names:  # one at a time: bounded memory on the server and here
            try:
                out[name] = await self._fetch(name, meta.get(name))
            except (ValueError, WeightCheckError) as exc:  # refused by the server: reported with the others
                self.unreadable[name] = str(exc)
        return out


def _nulls_to_nan(data: Any) -> Any:
    if isinstance(data, list):
        return [_nulls_to_nan(x) for x in data]
    return float("nan") if data is None else data


def reader_for(engine: Any, index: int) -> EngineReader:
    name = engine_name(engine, index)
    model = getattr(engine, "model", None)
    if model is not None and hasattr(model, "state_dict"):
        return EngineReader(engine, name)
    if getattr(engine, "weight_checksums_supported", False) and hasattr(engine, "weight_checksums"):
        return RemoteReader(engine, name, checksums=True)
    if hasattr(engine, "get_weights_by_name"):
        return RemoteReader(engine, name, checksums=False)
    raise WeightCheckError(f"weights.check_update_equal cannot read the tensors of {name} ({type(engine).__name__}): "
                           f"it has no in-process model, no /miles/weight_checksums and no /get_weights_by_name")

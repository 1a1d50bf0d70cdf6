"""The worker extension of the vLLM servers the run launches (``--worker-extension-cls
miles_vllm_bridge.worker.MilesWorkerExtension``): importing it registers the ``miles``
weight-transfer backend in the worker process, and its methods (called over ``/collective_rpc``)
read the model back in the trainer's (Hugging Face) names, for checking a push:

- a packed parameter (``qkv_proj``, ``gate_up_proj``, from the model's ``packed_modules_mapping``)
  is split back into its parts along the output dimension by the layer's ``output_sizes``;
- ``lm_head.weight`` of a model with tied embeddings is ``embed_tokens.weight``;
- a weight held in FP8 (a model loaded from an FP8 checkpoint) reads back as its decoded values in
  the model's dtype and is published with format ``fp8``, so the trainer ships its codes and scales
  (:mod:`miles_vllm_bridge.fp8`).
Digests are :func:`miles_engine.weights.tensors.digest`'s (dtype, shape, bytes), kept in step by hand.
Read-back is for tensor-parallel size 1 (a shard of a larger group is not the trainer's tensor).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from miles_vllm_bridge import fp8
from miles_vllm_bridge.transfer import finish_reload, register, start_reload


def keep_cpu_linears_plain() -> None:
    """On CPU, vLLM packs every linear layer's weight for oneDNN after loading and drops the weight
    itself (the embedding / LM head keep theirs but compute from a packed copy): a later
    ``load_weights`` would then write into an empty parameter, or update a tensor the kernels no
    longer read, and nothing could be read back. The servers the run launches compute their linear
    layers with torch's ``linear`` on the weights in place instead: updated in place, read back as held."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.model_executor.layers.utils as layer_utils

    packed = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(packed, "miles_plain", False):
        return

    def plain(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return packed(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    plain.miles_plain = True  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = plain


register()
keep_cpu_linears_plain()


def digest(t: torch.Tensor) -> str:
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    h = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}{tuple(t.shape)}".encode())
    h.update(data)
    return h.hexdigest()


def _model(worker: Any) -> torch.nn.Module:
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    return model


def hf_tensors(model: torch.nn.Module, skip_modules: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every tensor of the model under the trainer's name (views: no copies), but those of
    ``skip_modules`` (FP8 layers: :mod:`miles_vllm_bridge.fp8` reads them)."""
    params = dict(model.named_parameters())
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    out: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        module_path, _, leaf = name.rpartition(".")
        if module_path in skip_modules:
            continue
        owner, _, packed_name = module_path.rpartition(".")
        parts = packed.get(packed_name)
        if not parts:
            out[name] = param.data
            continue
        module = model.get_submodule(module_path)
        sizes = list(getattr(module, "output_sizes", []) or [])
        if len(sizes) != len(parts) or sum(sizes) != param.shape[0]:
            raise RuntimeError(f"cannot split {name} {tuple(param.shape)} into {parts} (output_sizes {sizes}): "
                               f"read-back needs tensor-parallel size 1")
        start = 0
        for part, size in zip(parts, sizes):
            out[f"{owner}.{part}.{leaf}" if owner else f"{part}.{leaf}"] = param.data.narrow(0, start, size)
            start += size
    config = getattr(model, "config", None)
    if "lm_head.weight" not in out and getattr(config, "tie_word_embeddings", False):
        embed = next((n for n in out if n.endswith("embed_tokens.weight")), None)
        if embed is not None:
            out["lm_head.weight"] = out[embed]
    return out


class MilesWorkerExtension:
    """Mixed into vLLM's worker class: ``self`` is the worker."""

    def _tensors(self) -> tuple[torch.nn.Module, dict[str, fp8.HeldFp8], dict[str, torch.Tensor]]:
        model = _model(self)
        held = fp8.held_fp8(model)
        return model, held, hf_tensors(model, {h.module for h in held.values()})

    def _read(self, model: torch.nn.Module, held: dict[str, fp8.HeldFp8], plain: dict[str, torch.Tensor],
              name: str) -> torch.Tensor | None:
        if name in held:
            return fp8.decoded(model, held[name], self.vllm_config.model_config.dtype)
        return plain.get(name)

    def miles_weight_metadata(self) -> list[list[Any]]:
        _, held, plain = self._tensors()
        meta = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in plain.items()]
        return meta + fp8.metadata(held, self.vllm_config.model_config.dtype)

    def miles_weight_checksums(self, names_json: str = "null") -> dict[str, str]:
        names = json.loads(names_json)
        model, held, plain = self._tensors()
        wanted = [*plain, *held] if names is None else [n for n in names if n in plain or n in held]
        return {n: digest(self._read(model, held, plain, n)) for n in wanted}

    def miles_tensor_rows(self, name: str, truncate_size: str = "100") -> Any:
        """The tensor's first rows as float32 lists (None when there is no such tensor)."""
        tensor = self._read(*self._tensors(), name)
        if tensor is None:
            return None
        rows = tensor[: int(truncate_size)] if tensor.dim() else tensor
        return {"values": rows.detach().to("cpu", torch.float32).tolist()}

    def miles_load_safetensors(self, files_json: str) -> dict[str, Any]:
        """Load the named tensors of these safetensors files (the trainer's names; FP8 weights as
        their parts) into the model; ``{"loaded": n}`` or ``{"error": why}`` (the caller refuses the
        update, naming it)."""
        from safetensors.torch import load_file

        model = _model(self)
        try:  # every name checked before the model is touched
            named = [t for path in json.loads(files_json) for t in load_file(path).items()]
            named = fp8.to_checkpoint_names(named, fp8.held_fp8(model))
        except Exception as exc:  # noqa: BLE001 - the answer names it
            return {"error": f"{type(exc).__name__}: {exc}"}
        start_reload(model, self.vllm_config)
        try:
            model.load_weights(named)
        except Exception as exc:  # noqa: BLE001 - the answer names it
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            finish_reload(model, self.vllm_config)
        return {"loaded": len(named)}

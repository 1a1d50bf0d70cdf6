"""The worker extension of the vLLM servers the run launches (``--worker-extension-cls
miles_vllm_bridge.worker.MilesWorkerExtension``): importing it registers the ``miles``
weight-transfer backend in the worker process, and its methods (called over ``/collective_rpc``)
read the model back in the trainer's (Hugging Face) names, for checking a push:

- a packed parameter (``qkv_proj``, ``gate_up_proj``, from the model's ``packed_modules_mapping``)
  is split back into its parts along the output dimension by the layer's ``output_sizes``;
- ``lm_head.weight`` of a model with tied embeddings is ``embed_tokens.weight``.
Digests are :func:`miles_engine.weights.tensors.digest`'s (dtype, shape, bytes), kept in step by hand.
Read-back is for tensor-parallel size 1 (a shard of a larger group is not the trainer's tensor).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

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


def hf_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the model under the trainer's name (views: no copies)."""
    params = dict(model.named_parameters())
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    out: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        module_path, _, leaf = name.rpartition(".")
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

    def miles_weight_metadata(self) -> list[list[Any]]:
        return [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in hf_tensors(_model(self)).items()]

    def miles_weight_checksums(self, names_json: str = "null") -> dict[str, str]:
        names = json.loads(names_json)
        tensors = hf_tensors(_model(self))
        wanted = tensors if names is None else {n: tensors[n] for n in names if n in tensors}
        return {n: digest(t) for n, t in wanted.items()}

    def miles_tensor_rows(self, name: str, truncate_size: str = "100") -> Any:
        """The tensor's first rows as float32 lists (None when there is no such tensor)."""
        tensor = hf_tensors(_model(self)).get(name)
        if tensor is None:
            return None
        rows = tensor[: int(truncate_size)] if tensor.dim() else tensor
        return {"values": rows.detach().to("cpu", torch.float32).tolist()}

    def miles_load_safetensors(self, files_json: str) -> dict[str, Any]:
        """Load the named tensors of these safetensors files (the trainer's names) into the model;
        ``{"loaded": n}`` or ``{"error": why}`` (the caller refuses the update, naming it)."""
        from safetensors.torch import load_file

        model = _model(self)
        loaded = 0
        start_reload(model, self.vllm_config)
        try:
            for path in json.loads(files_json):
                tensors = load_file(path)
                model.load_weights(tensors.items())
                loaded += len(tensors)
        except Exception as exc:  # noqa: BLE001 - the answer names it
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            finish_reload(model, self.vllm_config)
        return {"loaded": loaded}

"""Build a causal LM locally from a model reference (:mod:`.source`), a config (dict /
``PretrainedConfig``) or a model instance. Never downloads (``local_files_only``)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from miles_engine.errors import ConfigError
from miles_engine.models.cache import cache_root
from miles_engine.models.source import fit_tiny_spec, parse_tiny_spec, resolve
from miles_engine.precision.checkpoint import contract_of, from_checkpoint

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; allowed: {', '.join(_DTYPES)}") from None


def config_from(source: Mapping[str, Any] | Any) -> Any:
    """A ``PretrainedConfig`` from a dict (needs ``model_type``) or a config instance."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return copy.deepcopy(source)
    data = dict(source)
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ConfigError("a model config dict needs 'model_type' (e.g. 'qwen3', 'qwen3_moe', 'llama')")
    return AutoConfig.for_model(model_type, **data)


def _from_config(config: Any, dtype: torch.dtype, seed: int, attn: str) -> Any:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(dtype)


def fit_draft_vocab(source: Any, vocab_size: int) -> Any:
    """A speculative draft given as a ``tiny:`` spec or a config without ``vocab_size`` takes the
    policy's vocabulary (a draft must share it); any other source is left as it is."""
    if isinstance(source, str):
        return fit_tiny_spec(source, vocab_size)
    if isinstance(source, dict) and "vocab_size" not in source:
        return {**source, "vocab_size": vocab_size}
    return source


def load_model(source: Any, *, dtype: str = "float32", device: str = "cpu", seed: int = 0,
               attn_implementation: str = "sdpa") -> tuple[Any, str]:
    """Return ``(model in eval mode on device, description)``.

    ``source``: a ``PreTrainedModel`` (deep-copied: the engine's weights change only through
    ``update_weights``), a ``PretrainedConfig`` or dict (random init, seeded), or a model
    reference (:func:`~miles_engine.models.source.resolve`): a ``tiny:`` spec, ``package:<module>``,
    a ``config.json`` or config-only directory (random init, seeded), a ``.gguf`` file, or a
    directory holding HF weights (``from_pretrained(local_files_only=True)``) or a GGUF file.
    """
    from transformers import PretrainedConfig, PreTrainedModel

    tdtype = torch_dtype(dtype)
    if isinstance(source, PreTrainedModel):
        model, desc = copy.deepcopy(source).to(tdtype), f"instance:{type(source).__name__}"
    elif isinstance(source, (PretrainedConfig, Mapping)):
        model, desc = _from_config(config_from(source), tdtype, seed, attn_implementation), "config"
    elif isinstance(source, (str, Path)):
        src = resolve(source)
        desc = src.spec if src.path is None else str(src.path)
        if src.kind == "tiny":
            model = _from_config(config_from(parse_tiny_spec(src.spec)), tdtype, seed, attn_implementation)
        elif src.kind == "gguf":
            assert src.path is not None
            model = load_gguf_model(src.path, dtype=tdtype, attn_implementation=attn_implementation)
        elif src.kind == "hf":
            assert src.path is not None
            model = _load_hf_dir(src.path, tdtype, attn_implementation)
        else:  # "config": a config.json or a config-only directory
            file = src.path if src.path.is_file() else src.path / "config.json"  # type: ignore[union-attr]
            model = _from_config(config_from(json.loads(file.read_text())), tdtype, seed, attn_implementation)
    else:
        raise ConfigError(f"cannot build a model from {type(source).__name__}; give a path, a config or a model")
    model = model.to(device).eval()
    model.requires_grad_(False)
    return model, desc


def _load_hf_dir(path: Path, dtype: torch.dtype, attn: str) -> Any:
    from transformers import AutoModelForCausalLM

    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    try:
        contract = contract_of(config)
    except ValueError as exc:
        raise ConfigError(f"{path / 'config.json'}: {exc}") from None
    if contract is None:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True,
                                                    attn_implementation=attn)
    return load_quantized_dir(path, config, contract, dtype, attn)


def load_quantized_dir(path: Path, config: dict[str, Any], contract: dict[str, Any], dtype: torch.dtype,
                       attn: str) -> Any:
    """A directory written in a quantised format (:mod:`miles_engine.precision.checkpoint`): the
    model holds exactly the quantizer's values of its quantised weights."""
    from safetensors.torch import load_file

    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    model = _from_config(config_from(plain), torch.float32, 0, attn)
    saved: dict[str, Any] = {}
    for file in sorted(path.glob("*.safetensors")):
        saved.update(load_file(str(file)))
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    try:
        tensors = from_checkpoint(saved, contract, shapes, torch.float32)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(result.missing_keys) - tied)
    if missing or result.unexpected_keys:
        raise ConfigError(f"{path}: the {contract['format']} directory does not match its config: missing "
                          f"{missing[:5]}, unexpected {list(result.unexpected_keys)[:5]}")
    return model.to(dtype)


def load_gguf_model(path: Path, *, dtype: Any, attn_implementation: str) -> Any:
    """A GGUF file's model, dequantised once: the float32 result is cached as a safetensors
    directory under ``$MILES_CACHE_DIR/gguf/`` (keyed by the file's size and mtime), so the engine,
    the trainer process and later runs read it instead of dequantising again (minutes on a busy
    CPU). ``MILES_GGUF_CACHE=0`` turns the cache off."""
    from transformers import AutoModelForCausalLM

    st = path.stat()
    key = hashlib.sha256(f"v1|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_root() / "gguf" / f"{path.stem}-{key}"
    use_cache = os.environ.get("MILES_GGUF_CACHE", "1").strip().lower() not in ("0", "false", "no")
    if use_cache and (cached / "config.json").is_file() and any(cached.glob("*.safetensors")):
        return AutoModelForCausalLM.from_pretrained(str(cached), dtype=dtype, local_files_only=True,
                                                    attn_implementation=attn_implementation)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 local_files_only=True, attn_implementation=attn_implementation)
    # the tensors are plain float32 now: drop the GGUF "quantizer" so the model saves like any other
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if use_cache:
        tmp = cached.with_name(f".{cached.name}.tmp-{os.getpid()}")
        try:
            tmp.parent.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(str(tmp), safe_serialization=True)
            os.replace(tmp, cached)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return model.to(dtype)

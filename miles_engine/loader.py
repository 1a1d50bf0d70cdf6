"""The one loader for customisation points addressed by dotted import path."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from miles_engine.errors import ConfigError


def looks_like_import_path(ref: str) -> bool:
    return ":" in ref or ("." in ref and not ref.startswith(".") and "/" not in ref)


@functools.cache
def load_object(path: str) -> Any:
    """Import ``package.module:attr`` or ``package.module.attr`` and return the attribute."""
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise ConfigError(f"'{path}' is not an import path; expected 'package.module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import module '{module_name}' for '{path}': {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ConfigError(f"module '{module_name}' has no attribute '{attr_path}' (from '{path}')") from exc
    return obj

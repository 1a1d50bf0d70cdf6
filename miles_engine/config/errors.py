"""Turn pydantic validation errors into one line per fault naming key, file:line and allowed values."""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from miles_engine.errors import did_you_mean


def _submodel(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """Follow field annotations along ``loc`` to the model that owns its last element."""
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        candidates = [ann, *typing.get_args(ann)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return model


def _allowed(err: Mapping[str, Any]) -> str:
    ctx = err.get("ctx") or {}
    if "expected" in ctx:
        return f"; allowed: {ctx['expected']}"
    return ""


def format_validation_error(
    exc: ValidationError,
    *,
    prefix: str = "",
    model: type[BaseModel] | None = None,
    file: str | None = None,
    lines: Mapping[str, int] | None = None,
) -> str:
    """Render every error of ``exc`` as ``file:line: key: message`` lines."""
    out: list[str] = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc)
        full_key = f"{prefix}.{key}" if prefix and key else (prefix or key)
        where = ""
        if file:
            line = _line_for(lines or {}, full_key)
            where = f"{file}:{line}: " if line else f"{file}: "
        if err["type"] == "extra_forbidden":
            owner = _submodel(model, loc[:-1])
            known = sorted(owner.model_fields) if owner else []
            hint = did_you_mean(str(loc[-1]), known)
            allowed = f"; allowed keys: {', '.join(known)}" if known else ""
            out.append(f"{where}unknown key '{full_key}'{hint}{allowed}")
        elif err["type"] == "missing":
            out.append(f"{where}missing required key '{full_key}'")
        else:
            value = err.get("input")
            shown = f" (got {value!r})" if not isinstance(value, (dict, list)) else ""
            out.append(f"{where}bad value for '{full_key}'{shown}: {err['msg']}{_allowed(err)}")
    return "\n".join(out)


def _line_for(lines: Mapping[str, int], key: str) -> int | None:
    """The line of ``key`` or of its nearest enclosing key."""
    parts = key.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in lines:
            return lines[candidate]
        parts.pop()
    return None

"""Error types shared across the engine, each carrying one line a user can act on, and the
rendering of pydantic validation errors as one line per fault naming key, file:line and allowed values."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError


class MilesError(Exception):
    """Base class: a user-facing error whose message names the cause and the fix."""


class ConfigError(MilesError):
    """A recipe, override or options block is invalid."""


class PluginError(MilesError):
    """A plugin could not be loaded or registered."""


class UnknownComponentError(MilesError):
    """A name does not match any registered component of the requested kind."""


class DuplicateComponentError(PluginError):
    """Two distributions register the same name for one component kind."""


class TaskFormatError(MilesError):
    """A task directory or task file is malformed."""


class TaskUnsupportedError(TaskFormatError):
    """A well-formed task uses a feature of its format this reader does not support (the task is
    excluded with this reason; the other tasks of its set go on)."""


class SandboxUnsupportedError(MilesError):
    """A sandbox backend cannot meet what a task needs; the task is refused, never under-isolated."""


class SandboxError(MilesError):
    """A sandbox operation failed for a reason other than the command's own exit status."""


class HealthcheckError(SandboxError):
    """A sandbox's readiness check never passed: the environment is broken (the episode fails with
    this error; it is never scored as a reward of 0)."""


class RewardError(MilesError):
    """A verifier produced no usable reward (missing, empty, NaN or garbage reward file)."""


class EngineRequestError(MilesError, ValueError):
    """A rollout engine refused a request (ids out of vocabulary, empty or over-long prompt,
    bad sampling params, routed experts from a dense model); the engine keeps serving."""


class WeightUpdateError(MilesError, ValueError):
    """A weight update does not match the model (names, shapes, dtypes); it was refused before
    any tensor changed and the engine keeps serving the previous version."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def unknown_name(kind: str, name: str, available: Iterable[str]) -> UnknownComponentError:
    names = sorted(available)
    listing = ", ".join(names) if names else "none installed"
    return UnknownComponentError(
        f"unknown {kind} '{name}'{did_you_mean(name, names)}; available: {listing}"
    )

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

"""Error types shared across the engine. Each carries one line a user can act on."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


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


class SandboxUnsupportedError(MilesError):
    """A sandbox backend cannot meet what a task needs; the task is refused, never under-isolated."""


class SandboxError(MilesError):
    """A sandbox operation failed for a reason other than the command's own exit status."""


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

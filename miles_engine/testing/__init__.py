"""Contract suites for plugin authors: one pytest-ready suite per plugin kind.

Each module holds a base class a plugin's tests subclass, supplying a fixture that builds the
component under test; every test in the base class then runs against it.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "SandboxContract": "miles_engine.testing.sandbox",
    "EnvironmentContract": "miles_engine.testing.environment",
    "RewardContract": "miles_engine.testing.reward",
    "TeacherContract": "miles_engine.testing.teacher",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Imported on use: the suites import pytest, which the core does not depend on.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'miles_engine.testing' has no attribute '{name}'")

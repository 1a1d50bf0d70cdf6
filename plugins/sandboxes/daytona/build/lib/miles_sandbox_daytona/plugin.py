"""Registers the ``daytona`` sandbox backend."""

from __future__ import annotations

from miles_engine import hookimpl
from miles_engine.components import Component
from miles_sandbox_daytona.options import DaytonaSandboxOptions


def _make(options: DaytonaSandboxOptions):
    from miles_sandbox_daytona.backend import DaytonaSandboxBackend

    return DaytonaSandboxBackend(options)


@hookimpl
def miles_register_sandboxes() -> list[Component]:
    return [
        Component(
            "daytona",
            _make,
            options=DaytonaSandboxOptions,
            description="Daytona cloud containers (DAYTONA_API_KEY); registry images or Dockerfile builds",
        )
    ]

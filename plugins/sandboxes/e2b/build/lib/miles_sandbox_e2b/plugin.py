"""Registers the ``e2b`` sandbox backend."""

from __future__ import annotations

from miles_engine import hookimpl
from miles_engine.components import Component
from miles_sandbox_e2b.options import E2BSandboxOptions


def _make(options: E2BSandboxOptions):
    from miles_sandbox_e2b.backend import E2BSandboxBackend

    return E2BSandboxBackend(options)


@hookimpl
def miles_register_sandboxes() -> list[Component]:
    return [
        Component(
            "e2b",
            _make,
            options=E2BSandboxOptions,
            description="E2B cloud microVMs (E2B_API_KEY); images and Dockerfiles become cached templates",
        )
    ]

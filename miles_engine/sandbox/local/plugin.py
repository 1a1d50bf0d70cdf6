"""Built-in plugin registering the local sandbox backend."""

from __future__ import annotations

from miles_engine import hookimpl
from miles_engine.components import Component
from miles_engine.sandbox.local.backend import LocalSandboxBackend
from miles_engine.sandbox.local.options import LocalSandboxOptions


def _make(options: LocalSandboxOptions):
    return LocalSandboxBackend(options)


@hookimpl
def miles_register_sandboxes() -> list[Component]:
    return [
        Component(
            "local",
            _make,
            options=LocalSandboxOptions,
            description="subprocess + scratch dir + rlimits; Linux namespaces (bubblewrap/unshare) when available",
        )
    ]

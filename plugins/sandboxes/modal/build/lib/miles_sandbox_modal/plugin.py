"""Registers the ``modal`` sandbox backend."""

from __future__ import annotations

from miles_engine import hookimpl
from miles_engine.components import Component
from miles_sandbox_modal.options import ModalSandboxOptions


def _make(options: ModalSandboxOptions):
    from miles_sandbox_modal.backend import ModalSandboxBackend

    return ModalSandboxBackend(options)


@hookimpl
def miles_register_sandboxes() -> list[Component]:
    return [
        Component(
            "modal",
            _make,
            options=ModalSandboxOptions,
            description="Modal sandboxes (MODAL_TOKEN_ID/MODAL_TOKEN_SECRET); registry images or Dockerfile builds",
        )
    ]

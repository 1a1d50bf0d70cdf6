"""Sandboxes: one async protocol, many backends (local built in; Docker and clouds as plugins)."""

from miles_engine.sandbox.protocol import (
    RUN_LABEL,
    SANDBOX_LABEL,
    BuildContext,
    Capabilities,
    ExecResult,
    NetworkPolicy,
    Resources,
    Sandbox,
    SandboxBackend,
    SandboxSpec,
    SweepableBackend,
    check_supported,
)

__all__ = [
    "RUN_LABEL",
    "SANDBOX_LABEL",
    "BuildContext",
    "Capabilities",
    "ExecResult",
    "NetworkPolicy",
    "Resources",
    "Sandbox",
    "SandboxBackend",
    "SandboxSpec",
    "SweepableBackend",
    "check_supported",
]

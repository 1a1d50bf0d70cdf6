"""Sandboxes: one async protocol, many backends (local built in; Docker and clouds as plugins)."""

from miles_engine.sandbox.protocol import (
    BuildContext,
    Capabilities,
    ExecResult,
    NetworkPolicy,
    Resources,
    Sandbox,
    SandboxBackend,
    SandboxSpec,
    check_supported,
)

__all__ = [
    "BuildContext",
    "Capabilities",
    "ExecResult",
    "NetworkPolicy",
    "Resources",
    "Sandbox",
    "SandboxBackend",
    "SandboxSpec",
    "check_supported",
]

"""Helpers for the local sandbox tests: real subprocesses, real namespaces when the kernel
allows (probed, never assumed), and a bound on every test."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from miles_engine.sandbox.local.backend import LocalSandboxBackend
from miles_engine.sandbox.local.options import LocalSandboxOptions
from miles_engine.sandbox.local.probe import probe
from miles_engine.sandbox.protocol import NetworkPolicy, SandboxSpec

T = TypeVar("T")

PROBE = probe()
HAS_NS = PROBE.isolation == "namespace"
IS_ROOT = os.geteuid() == 0
needs_ns = pytest.mark.skipif(not HAS_NS, reason=f"kernel gives no user namespaces here: {PROBE.detail}")
needs_root = pytest.mark.skipif(not IS_ROOT, reason="dedicated per-sandbox uids need root")

# The process tier cannot block the network nor map absolute paths: ask only for what it has.
PROC_SPEC = SandboxSpec(paths=(), network=NetworkPolicy(mode="public"))


def run(coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
    """Run one coroutine on a fresh loop, bounded."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="session")
def ns_backend() -> LocalSandboxBackend:
    if not HAS_NS:
        pytest.skip(f"no namespaces: {PROBE.detail}")
    return LocalSandboxBackend(LocalSandboxOptions(isolation="namespace", kill_grace_s=0.3))


@pytest.fixture(scope="session")
def proc_backend() -> LocalSandboxBackend:
    return LocalSandboxBackend(LocalSandboxOptions(isolation="process", kill_grace_s=0.3))


@pytest.fixture(params=["namespace", "process"])
def tier(request: pytest.FixtureRequest) -> tuple[LocalSandboxBackend, SandboxSpec]:
    """Both tiers with the spec each supports."""
    if request.param == "namespace":
        return request.getfixturevalue("ns_backend"), SandboxSpec()
    return request.getfixturevalue("proc_backend"), PROC_SPEC

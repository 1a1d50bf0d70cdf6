"""The local backend passes the sandbox contract suite in both of its tiers."""

from __future__ import annotations

import pytest

from miles_engine.sandbox.local.backend import LocalSandboxBackend
from miles_engine.sandbox.local.options import LocalSandboxOptions
from miles_engine.testing import SandboxContract

from .conftest import HAS_NS, PROBE

pytestmark = pytest.mark.timeout(120)


@pytest.mark.skipif(not HAS_NS, reason=f"kernel gives no user namespaces here: {PROBE.detail}")
class TestLocalNamespaceContract(SandboxContract):
    def make_backend(self) -> LocalSandboxBackend:
        return LocalSandboxBackend(LocalSandboxOptions(isolation="namespace", kill_grace_s=0.3))


class TestLocalProcessContract(SandboxContract):
    def make_backend(self) -> LocalSandboxBackend:
        return LocalSandboxBackend(LocalSandboxOptions(isolation="process", kill_grace_s=0.3))

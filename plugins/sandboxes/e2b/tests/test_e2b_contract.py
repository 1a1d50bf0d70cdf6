"""The sandbox contract suite against the E2B backend, over the fake SDK (and over the real
cloud when E2B_API_KEY is set: ``pytest -m cloud``)."""

from __future__ import annotations

import os

import pytest
from fake_e2b import FakeCloud
from miles_sandbox_e2b.backend import E2BSandboxBackend
from miles_sandbox_e2b.options import E2BSandboxOptions

from miles_engine.testing.remote_fakes import namespaces_available
from miles_engine.testing.sandbox import SandboxContract

pytestmark = pytest.mark.skipif(not namespaces_available(), reason="the fake E2B runs commands in local namespaces")


class _FakeBackend(E2BSandboxBackend):
    async def aclose(self) -> None:
        await super().aclose()
        await self.cloud.aclose()


class TestE2BContractOnFake(SandboxContract):
    case_timeout_s = 40.0

    def make_backend(self):
        cloud = FakeCloud()
        backend = _FakeBackend(E2BSandboxOptions(kill_grace_s=0.5), sdk=cloud.sdk(), api_key=cloud.api_key)
        backend.cloud = cloud
        return backend

    async def labels_of(self, backend, sandbox):
        return backend.cloud.sandboxes[sandbox.transport.sandbox.sandbox_id].metadata


@pytest.mark.cloud
@pytest.mark.skipif(not os.environ.get("E2B_API_KEY"), reason="needs E2B_API_KEY (a real E2B account)")
class TestE2BContractOnCloud(SandboxContract):
    case_timeout_s = 180.0

    def make_backend(self):
        return E2BSandboxBackend(E2BSandboxOptions())

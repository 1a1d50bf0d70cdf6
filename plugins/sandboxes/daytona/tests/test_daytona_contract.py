"""The sandbox contract suite against the Daytona backend, over the fake SDK (and over the
real cloud when DAYTONA_API_KEY is set: ``pytest -m cloud``)."""

from __future__ import annotations

import os

import pytest
from fake_daytona import FakeCloud
from miles_sandbox_daytona.backend import DaytonaSandboxBackend
from miles_sandbox_daytona.options import DaytonaSandboxOptions

from miles_engine.testing.remote_fakes import namespaces_available
from miles_engine.testing.sandbox import SandboxContract

pytestmark = pytest.mark.skipif(not namespaces_available(), reason="the fake Daytona runs commands in local namespaces")


class _FakeBackend(DaytonaSandboxBackend):
    async def aclose(self) -> None:
        await super().aclose()
        await self.cloud.aclose()


class TestDaytonaContractOnFake(SandboxContract):
    case_timeout_s = 40.0

    def make_backend(self):
        cloud = FakeCloud()
        backend = _FakeBackend(DaytonaSandboxOptions(kill_grace_s=0.5), sdk=cloud.sdk(), api_key=cloud.api_key)
        backend.cloud = cloud
        return backend

    async def labels_of(self, backend, sandbox):
        return sandbox.transport.sandbox.labels


@pytest.mark.cloud
@pytest.mark.skipif(not os.environ.get("DAYTONA_API_KEY"), reason="needs DAYTONA_API_KEY (a real Daytona account)")
class TestDaytonaContractOnCloud(SandboxContract):
    case_timeout_s = 240.0

    def make_backend(self):
        return DaytonaSandboxBackend(DaytonaSandboxOptions())

    async def labels_of(self, backend, sandbox):
        await sandbox.transport.sandbox.refresh_data()
        return sandbox.transport.sandbox.labels

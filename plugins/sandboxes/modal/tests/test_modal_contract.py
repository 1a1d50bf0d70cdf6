"""The sandbox contract suite against the Modal backend, over the fake SDK (and over the real
cloud when MODAL_TOKEN_ID/MODAL_TOKEN_SECRET are set: ``pytest -m cloud``)."""

from __future__ import annotations

import os

import pytest
from fake_modal import FakeCloud
from miles_sandbox_modal.backend import ModalSandboxBackend
from miles_sandbox_modal.options import ModalSandboxOptions

from miles_engine.testing.remote_fakes import namespaces_available
from miles_engine.testing.sandbox import SandboxContract

pytestmark = pytest.mark.skipif(not namespaces_available(), reason="the fake Modal runs commands in local namespaces")

FAKE_TOKENS = {"MODAL_TOKEN_ID": "ak-fake-token-id", "MODAL_TOKEN_SECRET": "as-fake-token-secret"}


class _FakeBackend(ModalSandboxBackend):
    async def aclose(self) -> None:
        await super().aclose()
        await self.cloud.aclose()


class TestModalContractOnFake(SandboxContract):
    case_timeout_s = 40.0

    def make_backend(self):
        cloud = FakeCloud()
        mp = pytest.MonkeyPatch()
        for k, v in FAKE_TOKENS.items():
            mp.setenv(k, v)
        try:
            backend = _FakeBackend(ModalSandboxOptions(kill_grace_s=0.5), sdk=cloud.sdk())
        finally:
            mp.undo()
        backend.cloud = cloud
        return backend

    async def labels_of(self, backend, sandbox):
        return await sandbox.transport.sandbox.get_tags.aio()


@pytest.mark.cloud
@pytest.mark.skipif(not (os.environ.get("MODAL_TOKEN_ID") and os.environ.get("MODAL_TOKEN_SECRET")),
                    reason="needs MODAL_TOKEN_ID and MODAL_TOKEN_SECRET (a real Modal account)")
class TestModalContractOnCloud(SandboxContract):
    case_timeout_s = 300.0

    def make_backend(self):
        return ModalSandboxBackend(ModalSandboxOptions())

    async def labels_of(self, backend, sandbox):
        return await sandbox.transport.sandbox.get_tags.aio()

"""The Docker backend passes the sandbox contract suite: always against the fake engine,
and against a real Docker engine when one answers (skipped cleanly otherwise)."""

from __future__ import annotations

import json
import secrets

import pytest

from miles_engine.testing import SandboxContract
from miles_sandbox_docker.backend import DockerSandboxBackend
from miles_sandbox_docker.options import DockerSandboxOptions
from miles_sandbox_docker.sandbox import DockerSandbox

from .conftest import needs_bwrap

pytestmark = pytest.mark.timeout(180)


class _DockerLabels:
    async def labels_of(self, backend: DockerSandboxBackend, sandbox: DockerSandbox) -> dict[str, str]:
        res = await backend.cli.run(
            ["container", "inspect", "--format", "{{json .Config.Labels}}", sandbox.container], what="labels"
        )
        return json.loads(res.stdout)


@needs_bwrap
class TestDockerContractOnFakeEngine(_DockerLabels, SandboxContract):
    def make_backend(self, request: pytest.FixtureRequest) -> DockerSandboxBackend:
        fake = request.getfixturevalue("fake_engine")
        # the fake's containers share the host's /proc, so the in-container kill script reads every
        # process of the host: on a loaded box it may outlast the default 10 s bound
        return DockerSandboxBackend(DockerSandboxOptions(binary=fake.binary, run_id="contract-" + secrets.token_hex(3),
                                                         kill_timeout_s=60))

    def test_no_container_or_process_left(self, sandbox_backend: DockerSandboxBackend, fake_engine, run) -> None:
        run(sandbox_backend.aclose())
        assert fake_engine.containers() == [] and fake_engine.processes() == []


class TestDockerContractOnRealEngine(_DockerLabels, SandboxContract):
    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def _engine(cls, real_docker: str | None) -> None:
        if real_docker is not None:
            pytest.skip(real_docker)

    def make_backend(self) -> DockerSandboxBackend:
        return DockerSandboxBackend(DockerSandboxOptions(run_id="contract-" + secrets.token_hex(3)))

"""Modal failure modes on the fake SDK, and the spec → Modal parameter mapping."""

from __future__ import annotations

import asyncio

import pytest
from fake_modal import FakeCloud
from miles_sandbox_modal.backend import ModalSandboxBackend
from miles_sandbox_modal.options import ModalSandboxOptions
from modal.exception import AuthError, ConnectionError, ResourceExhaustedError

from miles_engine.errors import SandboxError
from miles_engine.sandbox.protocol import NetworkPolicy, Resources, SandboxSpec
from miles_engine.sandbox.remote import RetryPolicy
from miles_engine.testing.remote_fakes import namespaces_available

pytestmark = [
    pytest.mark.skipif(not namespaces_available(), reason="the fake Modal runs commands in local namespaces"),
    pytest.mark.timeout(60),
]
FAST = RetryPolicy(attempts=3, quota_attempts=3, base_delay_s=0.01, max_delay_s=0.02)
SPEC = SandboxSpec(network=NetworkPolicy(mode="none"))


@pytest.fixture(autouse=True)
def tokens(monkeypatch):
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-fake-token-id")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-fake-token-secret")


def run_with(body, **opts):
    async def main():
        cloud = FakeCloud()
        backend = ModalSandboxBackend(ModalSandboxOptions(retry=FAST, kill_grace_s=0.2, **opts), sdk=cloud.sdk())
        try:
            return await body(cloud, backend)
        finally:
            await backend.aclose()
            await cloud.aclose()

    return asyncio.run(main())


def live(cloud):
    return [sb for sb in cloud.sandboxes.values() if sb.returncode is None]


@pytest.mark.parametrize("missing", ["MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"])
def test_missing_token_is_one_line_naming_the_variable(monkeypatch, missing):
    monkeypatch.delenv(missing)
    with pytest.raises(SandboxError) as err:
        ModalSandboxBackend(ModalSandboxOptions())
    assert missing in str(err.value) and "\n" not in str(err.value)


def test_rejected_token_names_the_variables_and_never_the_secret():
    async def body(cloud, backend):
        cloud.fail("lookup", AuthError("Token secret as-fake-token-secret is invalid"))
        with pytest.raises(SandboxError) as err:
            await backend.create(SPEC)
        return str(err.value)

    msg = run_with(body)
    assert "MODAL_TOKEN_SECRET" in msg and "as-fake-token-secret" not in msg


def test_resource_exhausted_backs_off_then_fails_clearly():
    async def body(cloud, backend):
        cloud.fail("create", ResourceExhaustedError("concurrency limit"), times=2)
        async with await backend.create(SPEC) as sb:
            ok = (await sb.exec("echo ok")).stdout
        cloud.fail("create", ResourceExhaustedError("concurrency limit"), times=5)
        with pytest.raises(SandboxError) as err:
            await backend.create(SPEC)
        return ok, str(err.value), len(live(cloud))

    ok, msg, n = run_with(body)
    assert ok == "ok\n" and "throttling / over quota" in msg and n == 0


def test_lost_create_answer_leaves_no_orphan():
    async def body(cloud, backend):
        cloud.fail("create_lost_answer", ConnectionError("stream closed"))
        async with await backend.create(SPEC) as sb:
            assert (await sb.exec("true")).ok
            return len(cloud.sandboxes), len(live(cloud))

    assert run_with(body) == (2, 1)


def test_dropped_stream_collects_the_result_without_rerunning():
    async def body(cloud, backend):
        async with await backend.create(SPEC) as sb:
            cloud.fail("exec_after_start", ConnectionError("connection lost"))
            res = await sb.exec("echo run >> /app/count; echo out; echo err >&2; exit 3")
            return res, await sb.read_file("/app/count")

    res, count = run_with(body)
    assert (res.exit_code, res.stdout, res.stderr) == (3, "out\n", "err\n")
    assert count == b"run\n"


def test_sweep_terminates_a_runs_sandboxes_once():
    async def body(cloud, backend):
        spec = SPEC.model_copy(update={"labels": {"miles.run": "r1"}})
        made = [await backend.create(spec) for _ in range(2)]
        return sorted(await backend.sweep("r1")), sorted(sb.id for sb in made), await backend.sweep("r1")

    first, ids, second = run_with(body)
    assert first == ids and second == []


def test_resources_in_mib_network_and_gpus():
    backend = ModalSandboxBackend(ModalSandboxOptions(gpu="A10G"), sdk=FakeCloud.__new__(FakeCloud).sdk())
    spec = SandboxSpec(resources=Resources(cpus=1.5, memory_mb=1500, gpus=2), ttl_s=90.5,
                       network=NetworkPolicy(mode="allowlist", allowed_hosts=("pypi.org", "10.0.0.0/8")))
    kw = backend.create_kwargs(spec, {})
    assert (kw["cpu"], kw["memory"], kw["gpu"], kw["timeout"]) == (1.5, 1500, "A10G:2", 91)
    assert (kw["outbound_cidr_allowlist"], kw["outbound_domain_allowlist"]) == (["10.0.0.0/8"], ["pypi.org"])
    assert backend.capabilities().gpus
    assert not ModalSandboxBackend(ModalSandboxOptions(), sdk=backend.sdk).capabilities().gpus

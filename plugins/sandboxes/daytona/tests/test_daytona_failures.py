"""Daytona failure modes on the fake SDK, and the spec → Daytona parameter mapping."""

from __future__ import annotations

import asyncio

import pytest
from daytona import DaytonaConnectionError, DaytonaRateLimitError, DaytonaTimeoutError
from fake_daytona import FakeCloud
from miles_sandbox_daytona.backend import DaytonaSandboxBackend
from miles_sandbox_daytona.options import DaytonaSandboxOptions

from miles_engine.errors import SandboxError
from miles_engine.sandbox.protocol import NetworkPolicy, Resources, SandboxSpec
from miles_engine.sandbox.remote import RetryPolicy
from miles_engine.testing.remote_fakes import namespaces_available

pytestmark = [
    pytest.mark.skipif(not namespaces_available(), reason="the fake Daytona runs commands in local namespaces"),
    pytest.mark.timeout(60),
]
FAST = RetryPolicy(attempts=3, quota_attempts=3, base_delay_s=0.01, max_delay_s=0.02)
SPEC = SandboxSpec(network=NetworkPolicy(mode="none"))


def run_with(body, *, api_key: str | None = None):
    async def main():
        cloud = FakeCloud()
        backend = DaytonaSandboxBackend(DaytonaSandboxOptions(retry=FAST, kill_grace_s=0.2), sdk=cloud.sdk(),
                                        api_key=api_key or cloud.api_key)
        try:
            return await body(cloud, backend)
        finally:
            await backend.aclose()
            await cloud.aclose()

    return asyncio.run(main())


def live(cloud):
    return [sb for sb in cloud.sandboxes.values() if sb.state.value == "started"]


def test_missing_api_key_is_one_line_naming_the_variable(monkeypatch):
    monkeypatch.delenv("DAYTONA_API_KEY", raising=False)
    with pytest.raises(SandboxError) as err:
        DaytonaSandboxBackend(DaytonaSandboxOptions())
    assert "DAYTONA_API_KEY" in str(err.value) and "\n" not in str(err.value)


def test_rejected_key_names_the_variable_and_never_the_key():
    async def body(cloud, backend):
        with pytest.raises(SandboxError) as err:
            await backend.create(SPEC)
        return str(err.value)

    msg = run_with(body, api_key="dtn_wrong_secret_value")
    assert "DAYTONA_API_KEY" in msg and "dtn_wrong_secret_value" not in msg


def test_throttled_create_backs_off_then_fails_clearly():
    async def body(cloud, backend):
        cloud.fail("create", DaytonaRateLimitError("Too many requests", status_code=429), times=2)
        async with await backend.create(SPEC) as sb:
            ok = (await sb.exec("echo ok")).stdout
        cloud.fail("create", DaytonaRateLimitError("Too many requests", status_code=429), times=5)
        with pytest.raises(SandboxError) as err:
            await backend.create(SPEC)
        return ok, str(err.value)

    ok, msg = run_with(body)
    assert ok == "ok\n" and "throttling / over quota" in msg


def test_lost_create_answer_leaves_no_orphan():
    async def body(cloud, backend):
        cloud.fail("create_lost_answer", DaytonaConnectionError("connection reset"))
        async with await backend.create(SPEC) as sb:
            assert (await sb.exec("true")).ok
            return len(cloud.sandboxes), len(live(cloud))

    assert run_with(body) == (2, 1)


def test_dropped_stream_collects_the_result_without_rerunning():
    async def body(cloud, backend):
        async with await backend.create(SPEC) as sb:
            cloud.fail("exec_after_start", DaytonaTimeoutError("Request timed out"))
            res = await sb.exec("echo run >> /app/count; echo out; echo err >&2; exit 3")
            return res, await sb.read_file("/app/count")

    res, count = run_with(body)
    assert (res.exit_code, res.stdout, res.stderr) == (3, "out\n", "err\n")  # streams apart despite the merge
    assert count == b"run\n"


def test_sweep_deletes_a_runs_sandboxes_once():
    async def body(cloud, backend):
        spec = SPEC.model_copy(update={"labels": {"miles.run": "r1"}})
        made = [await backend.create(spec) for _ in range(2)]
        return sorted(await backend.sweep("r1")), sorted(sb.id for sb in made), await backend.sweep("r1")

    first, ids, second = run_with(body)
    assert first == ids and second == []


def test_resources_in_gib_and_network_lists(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM python:3.12-slim\n")
    backend = DaytonaSandboxBackend(DaytonaSandboxOptions(), sdk=FakeCloud.__new__(FakeCloud).sdk(), api_key="k")
    spec = SandboxSpec(resources=Resources(cpus=1.5, memory_mb=1500, disk_mb=10 * 1024),
                       network=NetworkPolicy(mode="allowlist", allowed_hosts=("pypi.org", "10.0.0.0/8")), ttl_s=90)
    p = backend.create_params(spec, {"miles.run": "r"})
    assert (p.resources.cpu, p.resources.memory, p.resources.disk) == (2, 2, 10)
    assert p.image == "python:3.12-slim" and p.ttl_minutes == 2
    assert (p.network_allow_list, p.domain_allow_list, p.network_block_all) == ("10.0.0.0/8", "pypi.org", False)
    plain = backend.create_params(SPEC, {})
    assert type(plain).__name__ == "CreateSandboxFromSnapshotParams" and plain.network_block_all is True

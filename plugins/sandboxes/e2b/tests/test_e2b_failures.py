"""E2B failure modes on the fake SDK: credentials, auth, throttling, lost answers, dropped
streams, and the spec → E2B parameter mapping."""

from __future__ import annotations

import asyncio

import pytest
from e2b.exceptions import (
    RateLimitException,
    SandboxUnreachableException,
    ServiceBusyException,
)
from fake_e2b import FakeCloud
from miles_sandbox_e2b.backend import E2BSandboxBackend
from miles_sandbox_e2b.options import E2BSandboxOptions

from miles_engine.errors import SandboxError
from miles_engine.sandbox.protocol import NetworkPolicy, Resources, SandboxSpec
from miles_engine.sandbox.remote import RetryPolicy
from miles_engine.testing.remote_fakes import namespaces_available

pytestmark = [
    pytest.mark.skipif(not namespaces_available(), reason="the fake E2B runs commands in local namespaces"),
    pytest.mark.timeout(60),
]
FAST = RetryPolicy(attempts=3, quota_attempts=3, base_delay_s=0.01, max_delay_s=0.02)
SPEC = SandboxSpec(network=NetworkPolicy(mode="none"))


def run_with(body, *, api_key: str | None = None, **opts):
    async def main():
        cloud = FakeCloud()
        backend = E2BSandboxBackend(E2BSandboxOptions(retry=FAST, kill_grace_s=0.2, **opts), sdk=cloud.sdk(),
                                    api_key=api_key or cloud.api_key)
        try:
            return await body(cloud, backend)
        finally:
            await backend.aclose()
            await cloud.aclose()

    return asyncio.run(main())


def live(cloud: FakeCloud) -> list:
    return [sb for sb in cloud.sandboxes.values() if not sb.box.killed]


def test_missing_api_key_is_one_line_naming_the_variable(monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(SandboxError) as err:
        E2BSandboxBackend(E2BSandboxOptions())
    assert "E2B_API_KEY" in str(err.value) and "\n" not in str(err.value)


def test_rejected_key_names_the_variable_and_never_the_key():
    async def body(cloud, backend):
        with pytest.raises(SandboxError) as err:
            await backend.create(SPEC)
        return str(err.value)

    msg = run_with(body, api_key="e2b_wrong_secret_value")
    assert "E2B_API_KEY" in msg and "e2b_wrong_secret_value" not in msg


def test_throttled_create_backs_off_then_succeeds():
    async def body(cloud, backend):
        cloud.fail("create", RateLimitException("Rate limit exceeded"), times=2)
        async with await backend.create(SPEC) as sb:
            return (await sb.exec("echo ok")).stdout, len(live(cloud))

    assert run_with(body) == ("ok\n", 1)


def test_quota_that_never_clears_is_one_clear_error():
    async def body(cloud, backend):
        cloud.fail("create", ServiceBusyException("no capacity"), times=10)
        with pytest.raises(SandboxError) as err:
            await backend.create(SPEC)
        return str(err.value), len(live(cloud))

    msg, n = run_with(body)
    assert "throttling / over quota" in msg and "3 tries" in msg and n == 0


def test_lost_create_answer_leaves_no_orphan():
    async def body(cloud, backend):
        cloud.fail("create_lost_answer", SandboxUnreachableException("connection reset"))
        async with await backend.create(SPEC) as sb:
            assert (await sb.exec("true")).ok
            return len(cloud.sandboxes), len(live(cloud))

    assert run_with(body) == (2, 1)  # the first (answer lost) was found by its label and killed


def test_dropped_stream_collects_the_result_without_rerunning():
    async def body(cloud, backend):
        async with await backend.create(SPEC) as sb:
            cloud.fail("run_after_start", SandboxUnreachableException("stream reset by peer"))
            res = await sb.exec("echo run >> /app/count; echo out; echo err >&2; exit 3")
            return res, await sb.read_file("/app/count")

    res, count = run_with(body)
    assert (res.exit_code, res.stdout, res.stderr) == (3, "out\n", "err\n")
    assert count == b"run\n"  # ran exactly once


def test_throttled_exec_is_asked_again_and_runs_once():
    async def body(cloud, backend):
        async with await backend.create(SPEC) as sb:
            cloud.fail("run", RateLimitException("Rate limit exceeded"))
            res = await sb.exec("echo run >> /app/count")
            return res.ok, await sb.read_file("/app/count")

    assert run_with(body) == (True, b"run\n")


def test_sweep_pages_through_and_is_idempotent():
    async def body(cloud, backend):
        spec = SPEC.model_copy(update={"labels": {"miles.run": "r1"}})
        made = [await backend.create(spec) for _ in range(3)]
        other = await backend.create(SPEC.model_copy(update={"labels": {"miles.run": "r2"}}))
        first, second = await backend.sweep("r1"), await backend.sweep("r1")
        alive = await other.alive()
        return sorted(first), sorted(sb.id for sb in made), second, alive

    first, ids, second, alive = run_with(body)
    assert first == ids and second == [] and alive


def test_images_and_resources_become_one_cached_template(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM python:3.12-slim\n")

    async def body(cloud, backend):
        spec = SPEC.model_copy(update={"image": "python:3.12-slim", "resources": Resources(cpus=1.5, memory_mb=3000)})
        for _ in range(2):
            await (await backend.create(spec)).close()
        from miles_engine.sandbox.protocol import BuildContext

        await (await backend.create(SPEC.model_copy(update={"build": BuildContext(context_dir=tmp_path)}))).close()
        creates = [c for op, c in cloud.calls if op == "create"]
        return cloud.templates, creates

    templates, creates = run_with(body)
    assert len(templates) == 2
    built = sorted(templates.values(), key=lambda t: t["cpu_count"] or 0)
    assert built[1]["cpu_count"] == 2 and built[1]["memory_mb"] == 3000
    assert ("from_image", "python:3.12-slim") in built[1]["steps"] and ("set_user", "root") in built[1]["steps"]
    assert creates[0]["template"] == creates[1]["template"] != creates[2]["template"]
    assert all(c["allow_internet_access"] is False for c in creates)


def test_allowlist_maps_to_allow_and_deny_out():
    async def body(cloud, backend):
        spec = SPEC.model_copy(update={"network": NetworkPolicy(mode="allowlist", allowed_hosts=("pypi.org", "10.0.0.0/8"))})
        await (await backend.create(spec)).close()
        return next(c for op, c in cloud.calls if op == "create")["network"]

    assert run_with(body) == {"allow_out": ["pypi.org", "10.0.0.0/8"], "deny_out": ["0.0.0.0/0"]}

"""Backend construction, the tier probe, concurrency and the unshare fallback."""

from __future__ import annotations

import asyncio
import time

import pytest

from miles_engine.errors import SandboxError
from miles_engine.sandbox.local import backend as backend_mod
from miles_engine.sandbox.local.backend import LocalSandboxBackend
from miles_engine.sandbox.local.options import LocalSandboxOptions
from miles_engine.sandbox.local.probe import Probe, find_tools, probe
from miles_engine.sandbox.protocol import SandboxBackend, SandboxSpec

from .conftest import HAS_NS, needs_ns, run

pytestmark = pytest.mark.timeout(90)


def test_backend_follows_the_protocol_and_the_hub_builds_it():
    from miles_engine.hub import Hub

    be = Hub().create("sandbox", "local", {"isolation": "process", "max_processes": 64})
    assert isinstance(be, SandboxBackend) and be.name == "local"
    assert be.options.max_processes == 64 and be.capabilities().isolation == "process"


def test_asking_for_namespaces_where_there_are_none_fails_clearly(monkeypatch):
    monkeypatch.setattr(backend_mod, "probe", lambda *a: Probe("process", None, "no namespaces: bwrap: nope"))
    with pytest.raises(SandboxError, match="isolation='namespace' was asked for but is not available.*bwrap: nope"):
        LocalSandboxBackend(LocalSandboxOptions(isolation="namespace"))
    auto = LocalSandboxBackend(LocalSandboxOptions(isolation="auto"))
    assert auto.capabilities().isolation == "process"  # never claims more than it achieved
    assert auto.capabilities().network_modes == {"public"}


def test_probe_reports_what_it_found():
    p = probe()
    assert p.isolation in ("namespace", "process") and p.detail
    assert (p.tools is not None) == (p.isolation == "namespace")


@pytest.mark.parametrize("isolation", ["namespace", "process"])
def test_many_concurrent_sandboxes_leave_nothing_behind(isolation, ns_backend, proc_backend):
    be = ns_backend if isolation == "namespace" else proc_backend
    spec = SandboxSpec() if isolation == "namespace" else SandboxSpec(paths=(), network={"mode": "public"})
    n = 24

    async def one(i: int):
        async with await be.create(spec) as sb:
            await sb.write_file(f"/app/in{i}.txt", str(i))
            r = await sb.exec(f"sleep 0.3; cat in{i}.txt; sleep 30 >/dev/null 2>&1 &")
            return r, sb

    async def go():
        t = time.monotonic()
        done = await asyncio.gather(*(one(i) for i in range(n)))
        return done, time.monotonic() - t

    done, took = run(go(), timeout=60)
    assert [r.stdout for r, _ in done] == [str(i) for i in range(n)]
    assert len({sb.id for _, sb in done}) == n
    assert sum(len(sb.leftover_processes()) for _, sb in done) == 0
    assert took < 30


@needs_ns
def test_unshare_fallback_tier():
    tools = find_tools("unshare")
    if isinstance(tools, str):
        pytest.skip(tools)
    be = LocalSandboxBackend(LocalSandboxOptions(isolation="namespace", namespace_tool="unshare"))
    assert be.probe.tools is not None and be.probe.tools.launcher == "unshare"

    async def go():
        async with await be.create(SandboxSpec(files={"/tests/t.sh": b"echo t"})) as sb:
            r = await sb.exec(
                "bash /tests/t.sh; id -u; touch /etc/x 2>/dev/null || echo ro; cat /etc/shadow >/dev/null "
                "2>&1 || echo noshadow; ls /proc | grep -c '^[0-9]'; tail -n +3 /proc/net/dev | cut -d: -f1;"
                "setsid sleep 303 </dev/null >/dev/null 2>&1 &"
            )
            await sb.write_file("/logs/r.txt", "1")
            return r, await sb.read_file("/logs/r.txt"), sb

    r, data, sb = run(go())
    lines = [x.strip() for x in r.stdout.split("\n") if x.strip()]
    assert lines[:4] == ["t", "0", "ro", "noshadow"]
    assert int(lines[4]) < 10 and lines[5:] == ["lo"]
    assert data == b"1" and sb.leftover_processes() == []


def test_auto_takes_the_tier_the_probe_found():
    """Namespaces where the kernel gives them, else the process tier (the fallback alone is
    checked with a probe that finds none: test_asking_for_namespaces_where_there_are_none_fails_clearly)."""
    assert LocalSandboxBackend().capabilities().isolation == ("namespace" if HAS_NS else "process")


def test_aclose_closes_what_is_open(proc_backend):
    async def go():
        be = LocalSandboxBackend(LocalSandboxOptions(isolation="process"))
        sbs = [await be.create(SandboxSpec(paths=(), network={"mode": "public"})) for _ in range(3)]
        for sb in sbs:
            await sb.exec("sleep 60 >/dev/null 2>&1 &")
        await be.aclose()
        return [await sb.alive() for sb in sbs], [sb.leftover_processes() for sb in sbs]

    alive, left = run(go())
    assert alive == [False] * 3 and left == [[]] * 3

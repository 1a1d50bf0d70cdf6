"""The local backend's warm pool: a closed namespace sandbox is reset in place and reused,
and nothing of one use reaches the next (files, processes, IPC objects, stale handles)."""

from __future__ import annotations

import asyncio
import os

import pytest

from miles_engine.errors import SandboxError
from miles_engine.sandbox.hostile import CASE_NAMES, run_hostile_suite
from miles_engine.sandbox.local import procscan, scratch
from miles_engine.sandbox.local.backend import LocalSandboxBackend
from miles_engine.sandbox.local.options import LocalSandboxOptions
from miles_engine.sandbox.protocol import NetworkPolicy, SandboxSpec
from miles_engine.testing import SandboxContract

from .conftest import HAS_NS, PROBE, run

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not HAS_NS or PROBE.tools is None or PROBE.tools.launcher != "bwrap",
                       reason=f"the warm pool needs the bubblewrap namespace tier: {PROBE.detail}"),
]

SPEC = SandboxSpec(workdir="/app", paths=("/app",), network=NetworkPolicy(mode="none"))

# Leaves something behind in every writable place, plus processes and a System V segment.
DIRTY = (
    "echo secret > /app/left; mkdir -p /app/d/e && echo x > /app/d/e/f; ln -s /etc/passwd /app/link; "
    "echo t > /tmp/t; echo r > /root/r; echo h > /home/h; echo s > /dev/shm/s; chmod 000 /app/d; "
    "python3 -c 'from multiprocessing import shared_memory' 2>/dev/null; "
    "ipcmk -M 4096 >/dev/null 2>&1; "
    "(sleep 300 &) ; setsid sleep 301 & nohup sleep 302 >/dev/null 2>&1 & "
    "echo done"
)


def backend(size: int = 4, **kw) -> LocalSandboxBackend:
    return LocalSandboxBackend(LocalSandboxOptions(isolation="namespace", kill_grace_s=0.3, warm_pool_size=size, **kw))


def test_reuse_starts_clean():
    async def go():
        b = backend()
        try:
            first = await b.create(SPEC)
            dirty = await first.exec(DIRTY)
            ipc_before = (await first.exec("ipcs -m | grep -c '^0x' || true")).stdout.strip()
            first_id, uid, pid1 = first.id, first.uid, first._pid1
            await first.close()
            again = await b.create(SandboxSpec(workdir="/app", paths=("/app",), network=NetworkPolicy(mode="none"),
                                               files={"/app/new.txt": "fresh"}))
            look = await again.exec(
                "ls -A /app /tmp /root /home /dev/shm; ps -e -o pid=,args= | grep -v ' ps ' ; "
                "echo ipc=$(ipcs -m | grep -c '^0x'); cat /app/new.txt")
            stale = None
            try:
                await first.exec("true")
            except SandboxError as exc:
                stale = str(exc)
            stats = dict(b.warm_stats)
            same_namespace = again._pid1 == pid1 and again.uid == uid
            await again.close()
            return dirty, ipc_before, first_id, uid, again.id, look, stale, stats, first, same_namespace
        finally:
            await b.aclose()

    dirty, ipc_before, first_id, uid, again_id, look, stale, stats, first, same_namespace = run(go())
    assert dirty.stdout.strip().endswith("done")
    assert same_namespace and again_id != first_id  # one namespace, a new id (process marker) per use
    assert stats == {"created": 1, "reused": 1, "parked": 1}
    out = look.stdout
    for name in ("left", "link", "/app/d", " t\n", "r\n", " h\n", " s\n"):
        assert name not in out.replace("/app:", ""), out
    assert "sleep" not in out, out  # every process of the first use is gone
    if ipc_before not in ("", "0"):
        assert "ipc=0" in out, out
    assert out.rstrip().endswith("fresh"), out
    assert stale is not None and "closed" in stale  # the old handle cannot reach the new user
    assert first.leftover_processes() == []
    assert procscan.find_processes(uid=uid) == []  # aclose destroyed the parked sandbox


def test_hostile_suite_through_a_warm_pool():
    """Every hostile case contained, and each later case runs in a reset sandbox of an
    earlier one: what a case leaves behind must not survive the reset."""
    async def go():
        b = backend(size=3)
        try:
            results = await run_hostile_suite(b, concurrency=3)
            return results, dict(b.warm_stats)
        finally:
            await b.aclose()

    results, stats = run(go(), timeout=100)
    assert [r.case for r in results] == list(CASE_NAMES)
    assert {r.case: r.detail for r in results if not r.contained} == {}
    assert all(r.leftover_processes == 0 for r in results)
    assert stats["reused"] >= len(CASE_NAMES) - 6, stats


def test_pool_size_is_a_bound_and_dead_sandboxes_are_not_reused():
    async def go():
        b = backend(size=1)
        try:
            a, c = await b.create(SPEC), await b.create(SPEC)
            await a.close()
            await c.close()  # pool full: destroyed
            parked = [sb for sbs in b._warm.values() for sb in sbs]
            assert len(parked) == 1
            procscan.kill_pids([parked[0]._pid1])  # dies while idle
            await asyncio.sleep(0.2)
            d = await b.create(SPEC)
            r = await d.exec("echo ok")
            stats = dict(b.warm_stats)
            await d.close()
            return r, stats
        finally:
            await b.aclose()

    r, stats = run(go())
    assert r.stdout == "ok\n"
    assert stats["reused"] == 0 and stats["created"] == 3 and stats["parked"] == 1


def test_a_sandbox_too_big_to_wipe_is_destroyed_not_parked():
    async def go():
        b = backend()
        try:
            sb = await b.create(SPEC)
            await sb.exec("mkdir /app/many && cd /app/many && seq 1 2500 | xargs touch")
            scratch_dir = sb.scratch
            await sb.close()
            return dict(b.warm_stats), scratch_dir
        finally:
            await b.aclose()

    stats, scratch_dir = run(go())
    assert stats["parked"] == 0
    assert not os.path.exists(scratch_dir)


def test_wipe_removes_symlinks_without_following_them(tmp_path):
    target = tmp_path / "outside"
    target.mkdir()
    (target / "keep").write_text("host file")
    top = tmp_path / "mapped"
    (top / "sub").mkdir(parents=True)
    (top / "sub" / "f").write_text("x")
    (top / "link").symlink_to(target)
    os.chmod(top / "sub", 0)
    assert scratch.wipe([str(top)], None)
    assert list(top.iterdir()) == [] and (target / "keep").read_text() == "host file"
    assert not scratch.wipe([str(target)], None, budget=0)


def test_different_mounts_or_network_never_share_a_sandbox():
    async def go():
        b = backend()
        try:
            sb = await b.create(SPEC)
            await sb.close()
            other = await b.create(SandboxSpec(workdir="/work", paths=("/work",), network=NetworkPolicy(mode="none")))
            await other.close()
            return dict(b.warm_stats)
        finally:
            await b.aclose()

    assert run(go())["reused"] == 0


class TestWarmLocalContract(SandboxContract):
    def make_backend(self) -> LocalSandboxBackend:
        return backend(size=2)


def test_a_mode_change_alone_is_undone():
    """Nothing left in the dirs, but the sandbox changed a mapped dir's own mode."""
    async def go():
        b = backend()
        try:
            sb = await b.create(SPEC)
            await sb.exec("chmod 0700 /app; chmod 0 /dev/shm")
            await sb.close()
            again = await b.create(SPEC)
            r = await again.exec("stat -c %a /app /dev/shm")
            await again.close()
            return r, dict(b.warm_stats)
        finally:
            await b.aclose()

    r, stats = run(go())
    assert stats["reused"] == 1 and r.stdout.split() == ["755", "755"], r

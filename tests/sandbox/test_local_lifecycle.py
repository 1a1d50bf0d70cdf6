"""Lifecycle edge cases: a dying sandbox, a dying parent, leftovers, options."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from miles_engine.errors import SandboxError
from miles_engine.sandbox.local import scratch
from miles_engine.sandbox.local.backend import LocalSandboxBackend
from miles_engine.sandbox.local.options import LocalSandboxOptions
from miles_engine.sandbox.local.procscan import find_processes
from miles_engine.sandbox.protocol import Resources, SandboxSpec

from .conftest import IS_ROOT, PROC_SPEC, needs_ns, needs_root, run

pytestmark = pytest.mark.timeout(60)


@needs_ns
def test_kill_everything_inside_does_not_kill_the_sandbox(ns_backend):
    async def go():
        async with await ns_backend.create(SandboxSpec()) as sb:
            r = await sb.exec(
                "sleep 100 >/dev/null 2>&1 & sleep 0.1; kill -9 -1; kill -TERM 1; kill -INT 1; echo alive"
            )
            again = await sb.exec("echo still")
            sig = await sb.exec("kill -9 $$")
            return r, again, sig, await sb.alive()

    r, again, sig, alive = run(go())
    assert r.stdout == "alive\n" and again.stdout == "still\n" and alive
    assert sig.exit_code == 137


@needs_ns
def test_a_sandbox_whose_init_died_reports_dead(ns_backend):
    async def go():
        sb = await ns_backend.create(SandboxSpec())
        os.kill(sb._pid1, 9)
        time.sleep(0.3)
        alive = await sb.alive()
        with pytest.raises(SandboxError, match="dead"):
            await sb.exec("true")
        await sb.close()
        return alive, sb.leftover_processes()

    alive, left = run(go())
    assert not alive and left == []


@needs_ns
def test_sandbox_dies_with_its_parent_process():
    code = textwrap.dedent("""
        import asyncio
        from miles_engine.sandbox.local.backend import LocalSandboxBackend
        from miles_engine.sandbox.protocol import SandboxSpec
        async def main():
            sb = await LocalSandboxBackend().create(SandboxSpec())
            await sb.exec("setsid sleep 304 </dev/null >/dev/null 2>&1 &")
            print(sb.id, sb.uid, flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        line = child.stdout.readline()
        assert line, child.stderr.read()
        sid, uid = line.split()
        uid_n = None if uid == "None" else int(uid)
        deadline = time.monotonic() + 5
        while not any("sleep 304" in p.cmdline for p in find_processes(uid=uid_n, sandbox_id=sid)):
            assert time.monotonic() < deadline, "the daemon never started"
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and find_processes(uid=uid_n, sandbox_id=sid):
        time.sleep(0.1)
    assert find_processes(uid=uid_n, sandbox_id=sid) == []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"miles-{sid}-*")):
        shutil.rmtree(path)  # its owner died: the next backend's sweep would do this after a minute


def test_stale_scratch_dirs_of_dead_owners_are_swept():
    root = tempfile.mkdtemp(prefix="miles-sweep-test-")
    os.chmod(root, 0o711)
    old = time.time() - 3600
    try:
        dirs = {name: os.path.join(root, name) for name in ("miles-sbx-dead-x", "miles-sbx-live-x", "miles-sbx-new-x")}
        for path in dirs.values():
            os.makedirs(os.path.join(path, "fs", "work"))
        held = scratch.hold(dirs["miles-sbx-live-x"])
        os.utime(dirs["miles-sbx-dead-x"], (old, old))
        os.utime(dirs["miles-sbx-live-x"], (old, old))
        be = LocalSandboxBackend(LocalSandboxOptions(isolation="process", scratch_root=root))
        assert be._sweep.result(timeout=10) == [dirs["miles-sbx-dead-x"]]
        assert sorted(os.listdir(root)) == ["miles-sbx-live-x", "miles-sbx-new-x"]
        os.close(held)
    finally:
        shutil.rmtree(root)


def test_keep_scratch_and_scratch_root(tier):
    backend, spec = tier
    root = tempfile.mkdtemp(prefix="miles-scratch-test-")
    os.chmod(root, 0o711)
    be = LocalSandboxBackend(backend.options.model_copy(update={"keep_scratch": True, "scratch_root": root}))

    async def go():
        async with await be.create(spec) as sb:
            await sb.write_file("kept.txt", "k")
            return sb.scratch

    try:
        scratch = run(go())
        assert scratch.startswith(root) and os.path.isdir(scratch)
        found = [os.path.join(d, f) for d, _, fs in os.walk(scratch) for f in fs if f == "kept.txt"]
        assert len(found) == 1 and open(found[0]).read() == "k"
    finally:
        shutil.rmtree(root)


def test_tmpfs_scratch_root_holds_the_sandbox_files_in_memory(tier):
    backend, spec = tier
    problem = scratch.tmpfs_problem(scratch.TMPFS_DIR)
    if problem:
        pytest.skip(f"no usable tmpfs here: {problem}")
    be = LocalSandboxBackend(backend.options.model_copy(update={"scratch_root": "tmpfs"}))
    assert be.options.scratch_root == scratch.TMPFS_DIR

    async def go():
        async with await be.create(spec) as sb:
            await sb.write_file("mem.txt", "m")
            r = await sb.exec("yes | head -2")
            return sb.scratch, r

    where, r = run(go())
    assert where.startswith(scratch.TMPFS_DIR + "/") and r.stdout == "y\ny\n" and not os.path.exists(where)


def test_tmpfs_scratch_root_falls_back_to_tmpdir_saying_why(tier, tmp_path, monkeypatch, caplog):
    backend, _ = tier
    monkeypatch.setattr(scratch, "TMPFS_DIR", str(tmp_path))
    expected = scratch.tmpfs_problem(str(tmp_path))
    if expected is None:
        pytest.skip("the test's tmp dir is itself a usable tmpfs")
    with caplog.at_level("WARNING", logger="miles_engine.sandbox.local.backend"):
        be = LocalSandboxBackend(backend.options.model_copy(update={"scratch_root": "tmpfs"}))
    assert be.options.scratch_root == tempfile.gettempdir()
    assert f"scratch_root 'tmpfs' falls back to {tempfile.gettempdir()}: {expected}" in caplog.text
    monkeypatch.setattr(scratch, "_mount_of", lambda path: ("/x", "tmpfs", {"rw", "noexec"}))
    assert "noexec" in scratch.tmpfs_problem(str(tmp_path))
    monkeypatch.setattr(scratch, "_mount_of", lambda path: ("/x", "ext4", {"rw"}))
    assert scratch.tmpfs_problem(str(tmp_path)) == f"{tmp_path} is ext4, not tmpfs"


@needs_root
def test_unreachable_scratch_root_is_a_clear_error(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    tmp_path.chmod(0o700)
    with pytest.raises(SandboxError, match="not reachable by the unprivileged sandbox users"):
        LocalSandboxBackend(LocalSandboxOptions(isolation="process", scratch_root=str(private)))


def test_memory_request_and_env_passthrough(tier, monkeypatch):
    backend, spec = tier
    monkeypatch.setenv("MY_TOOL_HOME", "/opt/tool")
    be = LocalSandboxBackend(backend.options.model_copy(update={"env_passthrough": ("MY_TOOL_HOME",)}))
    spec = spec.model_copy(update={"resources": Resources(memory_mb=512)})

    async def go():
        async with await be.create(spec) as sb:
            return await sb.exec("ulimit -v; echo $MY_TOOL_HOME")

    r = run(go())
    assert r.stdout.split() == [str(512 * 1024), "/opt/tool"]


@needs_ns
def test_public_network_and_hidden_paths(ns_backend):
    be = LocalSandboxBackend(ns_backend.options.model_copy(update={"hidden_paths": ("/opt",)}))
    host_ifaces = len(open("/proc/net/dev").read().splitlines()) - 2

    async def go():
        async with await be.create(SandboxSpec(network={"mode": "public"})) as sb:
            return await sb.exec("tail -n +3 /proc/net/dev | wc -l; ls -A /opt | wc -l")

    r = run(go())
    ifaces, opt_entries = r.stdout.split()
    assert int(ifaces) == host_ifaces and opt_entries == "0"


def test_process_tier_runs_in_its_scratch_dir(proc_backend):
    async def go():
        async with await proc_backend.create(PROC_SPEC.model_copy(update={"files": {"/app/f": b"x\n"}})) as sb:
            r = await sb.exec("pwd; echo $HOME; echo $TMPDIR; cat f; id -u")
            return r, sb

    r, sb = run(go())
    pwd, home, tmp, content, uid = r.stdout.split()
    assert pwd == sb.host_workdir and home.startswith(sb.scratch) and tmp.startswith(sb.scratch)
    assert content == "x"
    assert (uid == str(sb.uid)) if IS_ROOT else uid == str(os.getuid())

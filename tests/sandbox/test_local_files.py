"""File operations: sandbox paths, limits, directory transfer, and symlink safety."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from miles_engine.errors import SandboxError

from .conftest import IS_ROOT, needs_ns, run

pytestmark = pytest.mark.timeout(60)


def test_write_read_roundtrip_modes_and_limits(tier):
    backend, spec = tier

    async def go():
        async with await backend.create(spec) as sb:
            await sb.write_file("/app/deep/er/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
            await sb.write_file("rel.bin", bytes(range(256)) * 10)
            ran = await sb.exec("./deep/er/run.sh; stat -c %a deep/er/run.sh")
            data = await sb.read_file("/app/rel.bin")
            head = await sb.read_file("rel.bin", max_bytes=10)
            with pytest.raises(FileNotFoundError):
                await sb.read_file("/app/missing.txt")
            with pytest.raises(IsADirectoryError):
                await sb.read_file("/app/deep")
            await sb.write_file("/app/rel.bin", b"")
            empty = await sb.read_file("/app/rel.bin")
            return ran, data, head, empty

    ran, data, head, empty = run(go())
    assert ran.stdout == "ran\n755\n"
    assert data == bytes(range(256)) * 10 and head == bytes(range(10)) and empty == b""


def test_initial_files_and_workdir(tier):
    backend, spec = tier
    files = {"/app/a.txt": b"A", "/app/sub/b.txt": b"B", "c.txt": b"C"}
    if backend.capabilities().absolute_paths:
        files["/tests/test.sh"] = b"exit 0\n"
    spec = spec.model_copy(update={"files": files})

    async def go():
        async with await backend.create(spec) as sb:
            return await sb.exec("cat a.txt sub/b.txt c.txt; ls -A")

    r = run(go())
    assert r.stdout.startswith("ABC") and r.exit_code == 0


@needs_ns
def test_task_paths_are_mapped_and_the_host_is_read_only(ns_backend, tmp_path):
    host_secret = Path("/tmp") / f"miles-test-secret-{os.getpid()}"
    host_secret.write_text("host-only")
    spec_kw = {"workdir": "/workspace/proj", "files": {"/solution/solve.sh": b"echo solved > /app/out\n"}}

    async def go():
        async with await ns_backend.create(ns_backend_spec(**spec_kw)) as sb:
            r = await sb.exec(
                "pwd; bash /solution/solve.sh && cat /app/out; for d in /app /logs /tests /solution /tmp /root; "
                "do touch $d/w && echo ok$d; done; touch /etc/x /usr/x 2>&1 | wc -l; ls /home | wc -l; "
                f"cat {host_secret} 2>&1; id -u; ls /proc | grep -c '^[0-9]'; "
                "cat /proc/net/dev | tail -n +3 | cut -d: -f1"
            )
            await sb.exec("echo kept > /tmp/keep")
            kept = await sb.read_file("/tmp/keep")
            return r, kept

    try:
        r, kept = run(go())
    finally:
        host_secret.unlink()
    lines = r.stdout.split("\n")
    assert lines[0] == "/workspace/proj" and lines[1] == "solved"
    assert lines[2:8] == [f"ok{d}" for d in ("/app", "/logs", "/tests", "/solution", "/tmp", "/root")]
    assert lines[8] == "2" and lines[9] == "0"  # /etc and /usr read-only; /home empty
    assert "No such file" in lines[10] and lines[11] == "0"
    assert int(lines[12]) < 10  # private PID view
    assert [x.strip() for x in lines[13:] if x.strip()] == ["lo"]  # no network but loopback
    assert kept == b"kept\n"


def ns_backend_spec(**kw):
    from miles_engine.sandbox.protocol import SandboxSpec

    return SandboxSpec(**kw)


def test_upload_and_download_dirs(tier, tmp_path):
    backend, spec = tier
    src = tmp_path / "src"
    (src / "pkg" / "deep").mkdir(parents=True)
    (src / "pkg" / "deep" / "x.py").write_text("print('x')\n")
    (src / "run.sh").write_text("#!/bin/sh\necho run\n")
    (src / "run.sh").chmod(0o755)
    (src / "blob").write_bytes(os.urandom(300_000))
    out = tmp_path / "out"

    async def go():
        async with await backend.create(spec) as sb:
            await sb.upload_dir(src, "/app/up")
            r = await sb.exec("cd up && ./run.sh && python3 pkg/deep/x.py && ln -s /etc/passwd evil && mkdir -p e/f")
            await sb.download_dir("/app/up", out)
            with pytest.raises(FileNotFoundError):
                await sb.download_dir("/app/nope", tmp_path / "nope")
            with pytest.raises(NotADirectoryError):
                await sb.upload_dir(src / "run.sh", "/app/x")
            return r

    r = run(go())
    assert r.stdout == "run\nx\n"
    assert (out / "pkg" / "deep" / "x.py").read_text() == "print('x')\n"
    assert (out / "blob").read_bytes() == (src / "blob").read_bytes()
    assert stat.S_IMODE((out / "run.sh").stat().st_mode) & 0o100
    assert (out / "e" / "f").is_dir()
    assert not (out / "evil").exists() or (out / "evil").is_symlink() and not os.path.isabs(os.readlink(out / "evil"))


def test_planted_symlinks_cannot_reach_host_files(tier, tmp_path):
    backend, spec = tier
    victim = tmp_path / "victim.txt"
    victim.write_text("host data")
    victim.chmod(0o644)

    async def go():
        async with await backend.create(spec) as sb:
            await sb.exec(f"ln -s /etc/shadow shadow; ln -s {victim} victim")
            with pytest.raises((SandboxError, FileNotFoundError)):
                data = await sb.read_file("shadow")
                assert b"root:" not in data
            try:
                await sb.write_file("victim", b"overwritten")
            except (SandboxError, FileNotFoundError):
                pass

    run(go())
    if IS_ROOT or backend.capabilities().isolation == "namespace":
        assert victim.read_text() == "host data"


def test_read_file_cap(tier):
    backend, spec = tier

    async def go():
        async with await backend.create(spec) as sb:
            await sb.exec("head -c 5000000 /dev/zero > big")
            part = await sb.read_file("big", max_bytes=1234)
            full = await sb.read_file("big")
            return part, full

    part, full = run(go())
    assert len(part) == 1234 and len(full) == 5_000_000

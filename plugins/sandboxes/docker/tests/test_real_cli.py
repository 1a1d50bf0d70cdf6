"""Every docker call the backend makes, replayed through the real docker CLI (when one is
installed) against an engine address that does not exist: the CLI must get as far as
connecting, so no flag, argument count or format is one it rejects."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from miles_engine.sandbox.protocol import BuildContext, NetworkPolicy, Resources, SandboxSpec
from miles_sandbox_docker.backend import DockerSandboxBackend
from miles_sandbox_docker.options import DockerSandboxOptions

from .conftest import FakeDocker, needs_bwrap

pytestmark = [pytest.mark.timeout(120), needs_bwrap]
REAL = shutil.which("docker")


async def session(be: DockerSandboxBackend, tmp: Path) -> None:
    ctx = tmp / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM debian:bookworm-slim\n")
    (tmp / "up").mkdir()
    (tmp / "up" / "f").write_text("x")
    spec = SandboxSpec(
        image="python:3.12-slim", env={"A": "1"}, resources=Resources(cpus=1, memory_mb=256),
        network=NetworkPolicy(mode="public"), user="0", ttl_s=600, files={"/app/seed": b"s"},
    )
    async with await be.create(spec) as sb:
        await sb.exec("sleep 5", timeout_s=0.5, env={"B": "2"}, user="0", cwd="/app")
        await sb.exec(["cat"], stdin=b"in")
        await sb.write_file("/app/f", b"1")
        await sb.read_file("/app/f")
        await sb.upload_dir(tmp / "up", "/app/up")
        await sb.download_dir("/app/up", tmp / "down")
        await sb.alive()
    async with await be.create(SandboxSpec(build=BuildContext(context_dir=ctx))):
        pass
    await be.sweep(be.run_id or "")


@pytest.mark.skipif(REAL is None, reason="no docker CLI installed to check our arguments against")
def test_the_real_cli_accepts_every_call_we_make(fake_docker: FakeDocker, tmp_path: Path):
    be = DockerSandboxBackend(DockerSandboxOptions(binary=fake_docker.binary, run_id="cli-check"))
    asyncio.run(asyncio.wait_for(session(be, tmp_path), 60))
    shapes = {}
    for call in fake_docker.calls():
        shapes.setdefault((call[0], call[1] if call[0] in ("image", "container", "cp") else ""), call)
    assert {s[0] for s in shapes} >= {"run", "exec", "cp", "rm", "ps", "pull", "build", "image", "container", "version"} - {"version"}
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    for call in shapes.values():
        res = subprocess.run([REAL, *call], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=20)
        out = res.stdout + res.stderr
        assert res.returncode != 0, call
        for rejected in ("unknown flag", "unknown shorthand", "Usage:", "invalid argument", "requires at least"):
            assert rejected not in out, f"docker rejects {call[:3]}...: {out.strip()[:300]}"

"""Fixtures for the Docker backend tests: the fake docker CLI over a temporary state dir,
and a probe for a real Docker engine (the real contract run skips cleanly without one)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from miles_sandbox_docker.options import DockerSandboxOptions

collect_ignore = ["tasks"]  # task fixtures: their tests/ run inside containers, not here
FAKE = Path(__file__).with_name("fake_docker.py")
MARK = b"FAKE_DOCKER_CONTAINER="


def _bwrap_works() -> str | None:
    """Why the fake's containers cannot run here, or None when they can."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    try:
        subprocess.run(
            ["bwrap", "--ro-bind", "/", "/", "--bind", "/proc", "/proc", "--dev", "/dev", "true"],
            check=True, capture_output=True, timeout=10,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        return f"bwrap cannot build a mount namespace here ({exc})"
    return None


BWRAP_PROBLEM = _bwrap_works()
needs_bwrap = pytest.mark.skipif(BWRAP_PROBLEM is not None, reason=f"fake docker containers need bwrap: {BWRAP_PROBLEM}")


@dataclass
class FakeDocker:
    """Handle on one fake engine: its CLI path and state dir, with fault injection."""

    binary: str
    state: Path

    def _write(self, name: str, data: object) -> None:
        (self.state / name).write_text(json.dumps(data))

    def registry(self, refs: dict[str, str]) -> None:
        self._write("registry.json", refs)

    def images(self) -> list[str]:
        p = self.state / "images.json"
        return json.loads(p.read_text()) if p.exists() else []

    def faults(self, **faults: object) -> None:
        self._write("faults.json", faults)

    def calls(self) -> list[list[str]]:
        p = self.state / "calls.log"
        return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []

    def containers(self) -> list[dict]:
        return [json.loads(m.read_text()) for m in (self.state / "containers").glob("*/meta.json")]

    def processes(self) -> list[int]:
        """Host processes still running inside any of this engine's containers."""
        ids = {c["id"].encode() for c in self.containers()} | {d.name.encode() for d in (self.state / "containers").iterdir()}
        found = []
        for d in Path("/proc").glob("[0-9]*"):
            try:
                env = (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(e.startswith(MARK) and e[len(MARK):] in ids for e in env):
                found.append(int(d.name))
        return found

    def kill_all(self) -> None:
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def make_fake(root: Path) -> FakeDocker:
    state = root / "state"
    (state / "containers").mkdir(parents=True)
    binary = root / "docker"
    binary.write_text(f'#!/bin/sh\nFAKE_DOCKER_STATE="{state}" exec "{sys.executable}" -S "{FAKE}" "$@"\n')
    binary.chmod(0o755)
    fake = FakeDocker(str(binary), state)
    fake.registry({"debian:bookworm-slim": "ok", "python:3.12-slim": "ok", "private/img": "denied", "busy/img": "ratelimit"})
    return fake


# Engine settings that scripts/container_engine.sh exports for the real engine; the fake
# engine's tests must not inherit them (its registry knows no miles-base image).
ENGINE_ENV = ("DOCKER_HOST", "MILES_DOCKER_BINARY", "MILES_DOCKER_IMAGE_MAP", "MILES_DOCKER_PUBLIC_NETWORK",
              "MILES_DOCKER_BUILD_NETWORK", "MILES_DOCKER_STAND_INS", "MILES_DOCKER_STAND_IN_BASE")


@pytest.fixture
def fake_docker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDocker]:
    for var in ENGINE_ENV:
        monkeypatch.delenv(var, raising=False)
    fake = make_fake(tmp_path)
    yield fake
    fake.kill_all()


@pytest.fixture(scope="session")
def real_docker() -> str | None:
    """Why no real engine is usable (skip reason), or None when ``docker version`` answers
    (``$MILES_DOCKER_BINARY version``: the podman CLI too)."""
    cli = os.environ.get("MILES_DOCKER_BINARY") or "docker"
    if shutil.which(cli) is None:
        return f"no {cli} CLI on PATH"
    try:
        res = subprocess.run([cli, "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True, timeout=5)
    except subprocess.TimeoutExpired:
        return "docker version did not answer within 5 s"
    if res.returncode != 0:
        return f"no Docker engine reachable: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode}"
    return None


@pytest.fixture(scope="class")
def fake_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeDocker]:
    """One fake engine shared by a test class (the contract run)."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ENGINE_ENV:
            mp.delenv(var, raising=False)
        fake = make_fake(tmp_path_factory.mktemp("fake-docker"))
        yield fake
        fake.kill_all()


@pytest.fixture(scope="module")
def real_engine(real_docker: str | None) -> None:
    """Skips the module, saying why, unless a real engine answers and has the base image."""
    if real_docker is not None:
        pytest.skip(f"{real_docker} (start one with scripts/container_engine.sh start)")
    mapped = DockerSandboxOptions().image_map.get("ubuntu:24.04")
    engine = os.environ.get("MILES_DOCKER_BINARY") or "docker"
    probe = subprocess.run([engine, "image", "inspect", mapped or "ubuntu:24.04"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip("no local image for ubuntu:24.04 and no image map for it (MILES_DOCKER_IMAGE_MAP; "
                    "scripts/container_engine.sh start builds one)")

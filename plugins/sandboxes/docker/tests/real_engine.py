"""Shared by the tests against a real container engine (test_real_engine*.py): the engine CLI
under test, and small helpers over the docker backend and that CLI."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
from pathlib import Path

from miles_engine.cli.main import main
from miles_engine.sandbox.protocol import RUN_LABEL
from miles_sandbox_docker.backend import DockerSandboxBackend
from miles_sandbox_docker.options import DockerSandboxOptions

TASKS = Path(__file__).with_name("tasks")
ENGINE = os.environ.get("MILES_DOCKER_BINARY") or "docker"  # the engine CLI under test (docker or podman)


def run(coro, timeout: float = 240.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def backend(**opts) -> DockerSandboxBackend:
    return DockerSandboxBackend(DockerSandboxOptions(run_id=opts.pop("run_id", "real-" + secrets.token_hex(3)), **opts))


def containers_of(run_id: str) -> list[str]:
    res = subprocess.run([ENGINE, "ps", "--all", "--quiet", "--filter", f"label={RUN_LABEL}={run_id}"],
                         capture_output=True, text=True, timeout=60, check=True)
    return res.stdout.split()


def exit_code(*argv: str) -> int:
    try:
        main(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def leftover(kind: str, run_id: str) -> list[str]:
    """The run's KIND objects (``volume``, ``network``) the engine still lists."""
    res = subprocess.run([ENGINE, kind, "ls", "--quiet", "--filter", f"label={RUN_LABEL}={run_id}"],
                         capture_output=True, text=True, timeout=60, check=True)
    return res.stdout.split()

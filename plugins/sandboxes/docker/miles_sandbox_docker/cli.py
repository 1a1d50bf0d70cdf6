"""The docker CLI as an async call: run it, bound it, and sort its failures.

Every docker call of the backend goes through :class:`DockerCli`. A failed call becomes
one of: :class:`EngineUnreachable` (no engine: not retried), :class:`NoSuchContainer`,
:class:`~miles_engine.sandbox.remote.QuotaError` (registry rate limit),
:class:`~miles_engine.sandbox.remote.TransientError` (dropped connection, engine 5xx, a call
that timed out) or a plain :class:`~miles_engine.errors.SandboxError` (anything else, e.g. a
bad image reference).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

from miles_engine.errors import SandboxError
from miles_engine.sandbox.remote import QuotaError, TransientError, read_capped

_UNREACHABLE = (
    "cannot connect to the docker daemon",
    "error during connect",
    "is the docker daemon running",
    "permission denied while trying to connect to the docker daemon",
)
_QUOTA = ("toomanyrequests", "too many requests", "rate limit", "quota")
_TRANSIENT = (
    "connection reset",
    "connection refused",
    "i/o timeout",
    "tls handshake timeout",
    "context deadline exceeded",
    "unexpected eof",
    "broken pipe",
    "503 service unavailable",
    "502 bad gateway",
    "500 internal server error",
    "server misbehaving",
    "temporary failure",
)
_NO_CONTAINER = ("no such container", "is not running", "is restarting", "marked for removal", "removal of container")


class EngineUnreachable(SandboxError):
    """No Docker engine answers (not started, wrong DOCKER_HOST, no permission on the socket)."""


class NoSuchContainer(SandboxError):
    """The container is gone or stopped (closed, swept, its ttl ran out, killed)."""


@dataclass(frozen=True)
class CliResult:
    rc: int
    stdout: bytes
    stderr: bytes
    truncated: bool = False  # stdout was longer than the call's max_stdout

    @property
    def err(self) -> str:
        return self.stderr.decode(errors="replace").strip()


def classify(what: str, stderr: str) -> SandboxError:
    """The error for a failed docker call, from its stderr."""
    low = stderr.lower()
    msg = f"{what}: {stderr.strip() or 'failed with no message'}"
    if any(s in low for s in _UNREACHABLE):
        return EngineUnreachable(
            f"{what}: no Docker engine reachable ({stderr.strip()}); start Docker or point the backend "
            f"option host= (DOCKER_HOST) at a running engine"
        )
    if any(s in low for s in _NO_CONTAINER):
        return NoSuchContainer(msg)
    if any(s in low for s in _QUOTA):
        return QuotaError(msg)
    if any(s in low for s in _TRANSIENT):
        return TransientError(msg)
    return SandboxError(msg)


class DockerCli:
    """Runs ``docker ARGS`` as a child process with a bounded wait."""

    def __init__(self, binary: str = "docker", host: str | None = None, call_timeout_s: float = 120.0) -> None:
        self.binary = binary
        self.host = host
        self.call_timeout_s = call_timeout_s
        self._path: str | None = None
        self._engine: str | None = None

    def executable(self) -> str:
        if self._path is None:
            found = shutil.which(self.binary)
            if found is None and self.binary == "docker":
                found = shutil.which("podman")  # Podman's CLI takes the same arguments
            if found is None:
                raise EngineUnreachable(
                    f"docker sandbox: the docker CLI '{self.binary}' was not found"
                    + (" on PATH" if os.sep not in self.binary else "")
                    + "; install the Docker CLI or set the backend option binary=/path/to/docker"
                )
            self._path = found
        return self._path

    def executable_or_name(self) -> str:
        try:
            return self.executable()
        except EngineUnreachable:
            return self.binary

    def engine_name(self) -> str:
        """'podman' when the CLI is Podman's (by name, or a docker shim script that runs it), else 'docker'."""
        if self._engine is None:
            path = self.executable_or_name()
            if "podman" in os.path.basename(path):
                self._engine = "podman"
            else:
                try:
                    with open(path, "rb") as f:
                        head = f.read(512)
                except OSError:
                    return "docker"  # not found yet: decided once it is
                self._engine = "podman" if head.startswith(b"#!") and b"podman" in head else "docker"
        return self._engine

    def label(self, key: str) -> str:
        """A ``--format`` template for one label of a ``ps`` / ``network ls`` / ``volume ls`` row
        (docker's rows have a Label function; podman's a Labels map)."""
        if self.engine_name() == "podman":
            return '{{index .Labels "' + key + '"}}'
        return '{{.Label "' + key + '"}}'

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.host:
            env["DOCKER_HOST"] = self.host
        return env

    async def spawn(self, args: Sequence[str], *, stdin: bool = False) -> asyncio.subprocess.Process:
        """Start ``docker ARGS`` with piped stdout/stderr (and stdin when asked)."""
        return await asyncio.create_subprocess_exec(
            self.executable(),
            *args,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.env(),
            start_new_session=True,  # a Ctrl-C of ours reaches the CLI only through us
        )

    async def run(
        self,
        args: Sequence[str],
        *,
        what: str,
        stdin: bytes | None = None,
        timeout_s: float | None = None,
        max_stdout: int = 64 << 20,
        check: bool = True,
    ) -> CliResult:
        """Run one docker call to completion, keeping at most ``max_stdout`` bytes of its
        output; raise the classified error when it fails (``check``), a
        :class:`TransientError` when it outlives ``timeout_s``."""
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        proc = await self.spawn(args, stdin=stdin is not None)
        try:
            out, err, rc = await asyncio.wait_for(_communicate(proc, stdin, max_stdout), timeout)
        except asyncio.TimeoutError:
            raise TransientError(f"{what}: docker did not answer within {timeout:.0f}s") from None
        finally:
            await _reap(proc)
        result = CliResult(rc, out[0], err[0], truncated=out[1])
        if check and rc != 0:
            raise classify(what, result.err)
        return result


async def _communicate(
    proc: asyncio.subprocess.Process, stdin: bytes | None, max_stdout: int
) -> tuple[tuple[bytes, bool], tuple[bytes, bool], int]:
    async def feed() -> None:
        if proc.stdin is None:
            return
        try:
            if stdin:
                proc.stdin.write(stdin)
                await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the call failed early; its stderr says why
        finally:
            proc.stdin.close()

    assert proc.stdout is not None and proc.stderr is not None
    _, out, err = await asyncio.gather(feed(), read_capped(proc.stdout, max_stdout), read_capped(proc.stderr, 1 << 20))
    return out, err, await proc.wait()


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Make sure the CLI process is gone (killed if still running) and waited for."""
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except asyncio.TimeoutError:  # pragma: no cover - a SIGKILLed child always exits
            pass

"""Start and stop an HTTP engine server as a subprocess in its own process group.

Shared by the SGLang launcher and the engine supervisor: spawn with ``start_new_session``
(so a kill reaches every child: tokenizer, scheduler, detokenizer…), log to a file, wait for
``GET /health`` with a deadline, surface the log tail on failure, stop with SIGTERM then SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from miles_engine.engines.errors import EngineUnavailable


class EngineStartError(EngineUnavailable):
    """The server process exited or did not become healthy in time (message has the log tail)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (another process may take it before the server binds: prefer
    ``--port 0`` with a port file where the server supports it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server process. ``port_file``: the server writes its bound port there (our server's
    ``--port-file``); otherwise ``port`` must be the port it was told to use."""

    def __init__(self, argv: Sequence[str], *, host: str = "127.0.0.1", port: int | None = None,
                 port_file: str | Path | None = None, env: Mapping[str, str] | None = None,
                 cwd: str | Path | None = None, log_path: str | Path | None = None,
                 health_path: str = "/health", name: str = "engine") -> None:
        if port is None and port_file is None:
            raise ValueError("give the server's port or a port file it writes")
        self.argv = [str(a) for a in argv]
        self.host = host
        self.port = port
        self.port_file = Path(port_file) if port_file else None
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.name = name
        self.health_path = health_path
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None
        self._group_swept = False  # the leader is reaped and its group killed: never signal that id again

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self._poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self._poll()

    def _poll(self) -> int | None:
        """The leader's exit code (reaping it). The moment it is reaped, what is left of its group
        is killed, and the group is never signalled again: once empty, its id is free for another
        process's group (pids wrap around, at 32768 on many hosts)."""
        assert self.proc is not None
        code = self.proc.poll()
        if code is not None and not self._group_swept:
            self._signal_group(signal.SIGKILL)
            self._group_swept = True
        return code

    def log_tail(self, lines: int = 40) -> str:
        try:
            data = self.log_path.read_bytes()[-32768:].decode("utf-8", "replace")
        except OSError:
            return "(no log)"
        return "\n".join(data.splitlines()[-lines:])

    def spawn(self) -> None:
        if self.alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        if self.port_file is not None:
            self.port_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} start: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, cwd=self.cwd, start_new_session=True)
            self._group_swept = False

    async def wait_ready(self, deadline_s: float) -> None:
        """Wait until ``GET /health`` answers 200; raise :class:`EngineStartError` (with the log
        tail) if the process exits or the deadline passes. The process is killed on failure."""
        end = time.monotonic() + deadline_s
        async with httpx.AsyncClient(timeout=httpx.Timeout(2.0)) as client:
            while True:
                code = self.returncode
                if code is not None:
                    self.kill()
                    raise EngineStartError(f"{self.name} exited with code {code} while starting; "
                                           f"log {self.log_path}:\n{self.log_tail()}")
                if time.monotonic() > end:
                    self.kill()
                    raise EngineStartError(f"{self.name} was not healthy within {deadline_s:.0f}s; "
                                           f"log {self.log_path}:\n{self.log_tail()}")
                if self.port_file is not None and self.port_file.exists():
                    with contextlib.suppress(ValueError):
                        self.port = int(self.port_file.read_text().strip())
                if self.port is not None:
                    with contextlib.suppress(httpx.TransportError):
                        if (await client.get(self.url + self.health_path)).status_code == 200:
                            return
                await asyncio.sleep(0.1)

    async def start(self, deadline_s: float = 120.0) -> None:
        self.spawn()
        await self.wait_ready(deadline_s)

    def _signal_group(self, sig: int) -> None:
        if self.proc is None or self._group_swept:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole process group and reap the leader (synchronous, for finalizers)."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._poll()

    async def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the group, wait ``grace_s``, then SIGKILL. Returns the exit code."""
        if self.proc is None:
            return None
        if self._poll() is None:
            self._signal_group(signal.SIGTERM)
            end = time.monotonic() + grace_s
            while self._poll() is None and time.monotonic() < end:
                await asyncio.sleep(0.05)
        self._signal_group(signal.SIGKILL)  # the leader outlived the grace: all of the group
        if self._poll() is None:
            await asyncio.to_thread(self.proc.wait, 5)
        self._poll()
        return self.proc.returncode


def server_command(model: str, *, engine_factory: str | None = None, dtype: str | None = None,
                   threads: int | None = None, python: str = sys.executable, extra: Sequence[str] = ()) -> list[str]:
    """argv of our HTTP server over the embedded engine (or ``engine_factory``) on loopback."""
    cmd = [python, "-m", "miles_engine.run.engine_server", "--model", model, "--host", "127.0.0.1"]
    if engine_factory:
        cmd += ["--engine-factory", engine_factory]
    if dtype:
        cmd += ["--dtype", dtype]
    if threads:
        cmd += ["--threads", str(threads)]
    return cmd + list(extra)

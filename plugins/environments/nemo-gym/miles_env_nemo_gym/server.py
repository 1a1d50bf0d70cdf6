"""A resources server started from a command: its own process group, a bounded wait until it
answers, and a process-group kill on close (also at interpreter exit, so nothing is orphaned)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path

import httpx

from miles_engine.errors import MilesError

from miles_env_nemo_gym.options import ServerCommandOptions

POLL_S = 0.1
TERM_GRACE_S = 5.0
LOG_TAIL_BYTES = 2000


class ResourcesServerError(MilesError):
    """A resources server could not be started or reached."""


def _kill_group(proc: subprocess.Popen[bytes], log_dir: tempfile.TemporaryDirectory[str] | None) -> None:
    """SIGTERM the process group, SIGKILL what is left after a grace period, reap the leader."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group id, even after it exited
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + TERM_GRACE_S
        while time.monotonic() < deadline:  # wait for the whole group, not only the leader
            proc.poll()
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.02)
        else:
            continue
        break
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=TERM_GRACE_S)
    if log_dir is not None:
        log_dir.cleanup()


class ServerProcess:
    """Start ``options.command`` once (thread-safe), wait until ``options.url`` answers, kill on close."""

    def __init__(self, options: ServerCommandOptions, *, env_name: str) -> None:
        self.options = options
        self.env_name = env_name
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._error: ResourcesServerError | None = None
        self._log_dir: tempfile.TemporaryDirectory[str] | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def log_path(self) -> Path | None:
        return Path(self._log_dir.name) / "server.log" if self._log_dir is not None else None

    def _log_tail(self) -> str:
        path = self.log_path
        if path is None or not path.exists():
            return ""
        data = path.read_bytes()[-LOG_TAIL_BYTES:].decode("utf-8", "replace").strip()
        return f"; its output ends with:\n{data}" if data else "; it printed nothing"

    def ensure_started(self) -> None:
        """Start the server if it is not running; raises the same error to every caller after a failure."""
        with self._lock:
            if self._error is not None:
                raise self._error
            if self.proc is not None:
                if self.proc.poll() is None:
                    return
                self._error = ResourcesServerError(
                    f"environment '{self.env_name}': resources server at {self.options.url} exited with code "
                    f"{self.proc.returncode}{self._log_tail()}")
                raise self._error
            try:
                self._start()
            except ResourcesServerError as exc:
                self._error = exc
                self.close()
                raise

    def _start(self) -> None:
        o = self.options
        argv = ["sh", "-c", o.command] if isinstance(o.command, str) else list(o.command)
        self._log_dir = tempfile.TemporaryDirectory(prefix="miles-nemo-gym-")
        log = open(self.log_path, "wb")  # noqa: SIM115 - handed to the child, closed right after
        try:
            self.proc = subprocess.Popen(argv, cwd=o.cwd, env={**os.environ, **o.env}, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            raise ResourcesServerError(f"environment '{self.env_name}': cannot start resources server command "
                                       f"{argv!r}: {exc}") from exc
        finally:
            log.close()
        self._finalizer = weakref.finalize(self, _kill_group, self.proc, self._log_dir)
        self._wait_ready()

    def _wait_ready(self) -> None:
        o = self.options
        assert self.proc is not None
        probe = o.url + (o.health_path or "/")
        deadline = time.monotonic() + o.startup_timeout_s
        last = "no answer yet"
        with httpx.Client(timeout=min(2.0, o.startup_timeout_s), trust_env=False) as client:
            while True:
                if self.proc.poll() is not None:
                    raise ResourcesServerError(
                        f"environment '{self.env_name}': resources server command exited with code "
                        f"{self.proc.returncode} before answering at {o.url}{self._log_tail()}")
                try:
                    answer = client.get(probe)
                    if o.health_path is None or answer.is_success:
                        return
                    last = f"HTTP {answer.status_code}"
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}"
                if time.monotonic() >= deadline:
                    raise ResourcesServerError(
                        f"environment '{self.env_name}': resources server did not answer at {probe} within "
                        f"{o.startup_timeout_s:g}s (server.startup_timeout_s; last: {last}){self._log_tail()}")
                time.sleep(POLL_S)

    def close(self) -> None:
        """Kill the server's process group (idempotent)."""
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer()
        elif self._log_dir is not None and self.proc is None:
            self._log_dir.cleanup()

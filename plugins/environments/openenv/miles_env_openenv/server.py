"""Where an OpenEnv server lives: a URL given in the recipe, or an app this plugin serves itself.

A served app runs as ``python -m uvicorn <module:attr>`` on 127.0.0.1 in its own process group,
started on first use and stopped by :meth:`LocalServer.stop` (also at interpreter exit), so no
server outlives the run.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import httpx

from miles_engine.errors import MilesError

LOG_TAIL_CHARS = 2000


class OpenEnvServerError(MilesError):
    """An OpenEnv server is unreachable, did not start, or answered outside its protocol."""


def ws_url(base_url: str) -> str:
    scheme, rest = base_url.split("://", 1)
    return f"{'wss' if scheme == 'https' else 'ws'}://{rest.rstrip('/')}/ws"


def fetch_json(base_url: str, path: str, timeout_s: float) -> dict[str, Any]:
    """GET ``base_url + path`` as a JSON object, with one error naming the URL on any failure."""
    url = base_url.rstrip("/") + path
    try:
        response = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise OpenEnvServerError(f"OpenEnv server at {url} is unreachable: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise OpenEnvServerError(f"OpenEnv server at {url} answered HTTP {response.status_code}: {response.text[:300]}")
    try:
        data = response.json()
    except ValueError as exc:
        raise OpenEnvServerError(f"OpenEnv server at {url} returned non-JSON: {response.text[:300]!r}") from exc
    if not isinstance(data, dict):
        raise OpenEnvServerError(f"OpenEnv server at {url} returned {type(data).__name__}, expected a JSON object")
    return data


class RemoteServer:
    """A server someone else runs."""

    def __init__(self, url: str) -> None:
        self.base_url = url.rstrip("/")
        self.label = self.base_url

    def ensure_started(self) -> str:
        return self.base_url

    def stop(self) -> None:
        return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _kill_group(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace_s)
    except ProcessLookupError:
        pass


class LocalServer:
    """An ASGI app (``module:attr``) this plugin serves with uvicorn on 127.0.0.1."""

    def __init__(self, app: str, *, python_path: list[Path] | None = None, startup_timeout_s: float = 120.0,
                 env: dict[str, str] | None = None) -> None:
        self.app = app
        self.label = f"app {app} (served on 127.0.0.1)"
        self.python_path = list(python_path or [])
        self.startup_timeout_s = startup_timeout_s
        self.extra_env = dict(env or {})
        self.base_url: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None

    def ensure_started(self) -> str:
        """Start the server once (thread-safe) and return its base URL once /health answers."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None and self.base_url:
                return self.base_url
            if self._proc is not None:  # it died since: say so rather than silently restarting
                raise OpenEnvServerError(f"OpenEnv {self.label} exited with code {self._proc.returncode}; "
                                         f"log tail:\n{self._log_tail()}")
            return self._start()

    def _start(self) -> str:
        port = _free_port()
        env = {**os.environ, **self.extra_env}
        paths = [str(p) for p in self.python_path] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        fd, log = tempfile.mkstemp(prefix="miles-openenv-", suffix=".log")
        self._log = Path(log)
        with os.fdopen(fd, "wb") as sink:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", self.app, "--host", "127.0.0.1", "--port", str(port),
                 "--log-level", "warning"],
                stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        self._finalizer = weakref.finalize(self, _stop_process, self._proc, self._log)
        atexit.register(self._finalizer)
        self.base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise OpenEnvServerError(f"OpenEnv {self.label} exited with code {self._proc.returncode} "
                                         f"during start-up; log tail:\n{self._log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return self.base_url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise OpenEnvServerError(f"OpenEnv {self.label} did not answer {self.base_url}/health within "
                                 f"{self.startup_timeout_s:g}s (raise startup_timeout_s if it is slow to import)")

    def _log_tail(self) -> str:
        try:
            return self._log.read_text(errors="replace")[-LOG_TAIL_CHARS:] if self._log else ""
        except OSError:
            return ""

    def stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # idempotent: kills the group and removes the log once


def _stop_process(proc: subprocess.Popen[bytes], log: Path) -> None:
    _kill_group(proc)
    log.unlink(missing_ok=True)

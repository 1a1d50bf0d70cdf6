"""One live E2B sandbox as a :class:`~miles_engine.sandbox.remote_sandbox.Transport`, and the
mapping of E2B's exceptions onto the retry classes of :mod:`miles_engine.sandbox.remote`."""

from __future__ import annotations

import shlex
from typing import Any

from miles_engine.errors import SandboxError
from miles_engine.sandbox.remote import QuotaError, TransientError, redact
from miles_engine.sandbox.remote_transport import SandboxGone, StreamLost

ROOT = "root"  # E2B's default user is 'user'; tasks expect root, as under Docker


def classify(exc: BaseException, *, what: str, api_key: str | None, dispatched: bool = False) -> BaseException:
    """The miles error for an E2B SDK exception raised by ``what``.

    ``dispatched``: the call started a model command, so a failure after sending it is a lost
    stream (never retried by sending again), not a transient error.
    """
    import httpx
    from e2b.exceptions import (
        AuthenticationException,
        FileNotFoundException,
        RateLimitException,
        SandboxNotFoundException,
        SandboxNotRunningException,
        SandboxUnreachableException,
        ServiceBusyException,
        TimeoutException,
    )

    msg = redact(str(exc), [api_key]) or type(exc).__name__
    if isinstance(exc, AuthenticationException):
        return SandboxError(f"e2b: {what}: the API key was rejected ({msg}); check E2B_API_KEY")
    if isinstance(exc, (RateLimitException, ServiceBusyException)):
        return QuotaError(f"e2b: {what}: {msg}")
    if isinstance(exc, (SandboxNotRunningException, SandboxNotFoundException)):
        return SandboxGone(f"e2b: {what}: the sandbox no longer exists ({msg})")
    if isinstance(exc, FileNotFoundException):
        return FileNotFoundError(msg)
    if isinstance(exc, (SandboxUnreachableException, TimeoutException, httpx.TransportError)):
        return StreamLost(f"e2b: {what}: {msg}") if dispatched else TransientError(f"e2b: {what}: {msg}")
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and status >= 500:
        return TransientError(f"e2b: {what}: HTTP {status}: {msg}")
    return SandboxError(f"e2b: {what}: {msg}")


class E2BTransport:
    """Runs the adapter's scripts through ``commands.run`` and moves files through ``files``."""

    def __init__(self, sandbox: Any, *, api_key: str, request_timeout_s: float) -> None:
        self.sandbox = sandbox  # e2b.AsyncSandbox
        self.api_key = api_key
        self.request_timeout_s = request_timeout_s

    async def run_script(self, script: str, *, timeout_s: float) -> str:
        from e2b import CommandExitException

        try:
            result = await self.sandbox.commands.run(
                "sh -c " + shlex.quote(script),
                user=ROOT,
                timeout=timeout_s,
                request_timeout=self.request_timeout_s,
            )
        except CommandExitException as exc:  # the wrapper exits 0; this is `sh` itself failing
            raise SandboxError(f"e2b: the shell failed to start (exit {exc.exit_code}): {exc.stderr.strip()[-300:]}") from None
        except Exception as exc:
            raise classify(exc, what="running a command", api_key=self.api_key, dispatched=True) from exc
        return result.stdout

    async def put_file(self, path: str, data: bytes) -> None:
        try:
            await self.sandbox.files.write(path, data, user=ROOT, request_timeout=self.request_timeout_s)
        except Exception as exc:
            raise classify(exc, what=f"writing {path}", api_key=self.api_key) from exc

    async def get_file(self, path: str) -> bytes:
        try:
            data = await self.sandbox.files.read(path, format="bytes", user=ROOT, request_timeout=self.request_timeout_s)
        except Exception as exc:
            raise classify(exc, what=f"reading {path}", api_key=self.api_key) from exc
        return bytes(data)

    async def is_alive(self) -> bool:
        try:
            return bool(await self.sandbox.is_running(request_timeout=self.request_timeout_s))
        except Exception as exc:
            raise classify(exc, what="checking the sandbox", api_key=self.api_key) from exc

    async def destroy(self) -> None:
        try:
            await self.sandbox.kill(request_timeout=self.request_timeout_s)  # False when already gone: fine
        except Exception as exc:
            err = classify(exc, what="killing the sandbox", api_key=self.api_key)
            if not isinstance(err, SandboxGone):
                raise err from exc

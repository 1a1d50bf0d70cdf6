"""One live Modal sandbox as a :class:`~miles_engine.sandbox.remote_sandbox.Transport`, and the
mapping of Modal's exceptions onto the retry classes of :mod:`miles_engine.sandbox.remote`.

Modal reports an exec that hit its own ``timeout`` as return code -1 (no exception); the exec
wrapper enforces timeouts itself, so a -1 here means the SDK gave up waiting: the result is
collected from the files the wrapper leaves, never by running the command again.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from miles_engine.errors import SandboxError
from miles_engine.sandbox.remote import QuotaError, TransientError, redact
from miles_engine.sandbox.remote_transport import SandboxGone, StreamLost


def classify(exc: BaseException, *, what: str, secrets: list[str | None], dispatched: bool = False) -> BaseException:
    from modal.exception import (
        AuthError,
        ConnectionError,
        InternalError,
        NotFoundError,
        PermissionDeniedError,
        ResourceExhaustedError,
        SandboxFilesystemIsADirectoryError,
        SandboxFilesystemNotFoundError,
        SandboxTerminatedError,
        ServiceError,
        TimeoutError,
    )

    msg = redact(str(exc), secrets) or type(exc).__name__
    if isinstance(exc, (AuthError, PermissionDeniedError)):
        return SandboxError(f"modal: {what}: the token was rejected ({msg}); check MODAL_TOKEN_ID and MODAL_TOKEN_SECRET")
    if isinstance(exc, ResourceExhaustedError):
        return QuotaError(f"modal: {what}: {msg}")
    if isinstance(exc, (SandboxFilesystemNotFoundError, SandboxFilesystemIsADirectoryError)):
        return FileNotFoundError(msg)
    if isinstance(exc, (NotFoundError, SandboxTerminatedError)):
        return SandboxGone(f"modal: {what}: the sandbox no longer exists ({msg})")
    if isinstance(exc, (ConnectionError, InternalError, ServiceError, TimeoutError, OSError)):
        return StreamLost(f"modal: {what}: {msg}") if dispatched else TransientError(f"modal: {what}: {msg}")
    return SandboxError(f"modal: {what}: {msg}")


class ModalTransport:
    def __init__(self, sandbox: Any, *, secrets: list[str | None]) -> None:
        self.sandbox = sandbox  # modal.Sandbox
        self.secrets = secrets

    async def run_script(self, script: str, *, timeout_s: float) -> str:
        try:
            proc = await self.sandbox.exec.aio("sh", "-c", script, timeout=math.ceil(timeout_s))
            # Drain both pipes while waiting, or a chatty command could block on a full pipe.
            out, _err, code = await asyncio.gather(proc.stdout.read.aio(), proc.stderr.read.aio(), proc.wait.aio())
        except Exception as exc:
            raise classify(exc, what="running a command", secrets=self.secrets, dispatched=True) from exc
        if code == -1:
            raise StreamLost("modal: the exec call timed out before the command's reply arrived")
        if code != 0:
            raise SandboxError(f"modal: the shell failed (exit {code}): {(_err or '').strip()[-300:]}")
        return out

    async def put_file(self, path: str, data: bytes) -> None:
        try:
            await self.sandbox.filesystem.write_bytes.aio(data, path)
        except Exception as exc:
            raise classify(exc, what=f"writing {path}", secrets=self.secrets) from exc

    async def get_file(self, path: str) -> bytes:
        try:
            return bytes(await self.sandbox.filesystem.read_bytes.aio(path))
        except Exception as exc:
            raise classify(exc, what=f"reading {path}", secrets=self.secrets) from exc

    async def is_alive(self) -> bool:
        try:
            return await self.sandbox.poll.aio() is None
        except Exception as exc:
            err = classify(exc, what="checking the sandbox", secrets=self.secrets)
            if isinstance(err, SandboxGone):
                return False
            raise err from exc

    async def destroy(self) -> None:
        try:
            await self.sandbox.terminate.aio()  # a no-op when it already finished
        except Exception as exc:
            err = classify(exc, what="terminating the sandbox", secrets=self.secrets)
            if not isinstance(err, SandboxGone):
                raise err from exc

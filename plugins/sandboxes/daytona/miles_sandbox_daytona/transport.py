"""One live Daytona sandbox as a :class:`~miles_engine.sandbox.remote_sandbox.Transport`, and
the mapping of Daytona's exceptions onto the retry classes of :mod:`miles_engine.sandbox.remote`.

``process.exec`` merges stdout and stderr; that does not matter here because the exec wrapper
keeps the command's streams apart in files and replies on stdout alone.
"""

from __future__ import annotations

import math
import shlex
from typing import Any

from miles_engine.errors import SandboxError
from miles_engine.sandbox.remote import QuotaError, TransientError, redact
from miles_engine.sandbox.remote_transport import SandboxGone, StreamLost


def classify(exc: BaseException, *, what: str, api_key: str | None, dispatched: bool = False) -> BaseException:
    """The miles error for a Daytona SDK exception raised by ``what`` (see the E2B twin)."""
    from daytona import (
        DaytonaAuthenticationError,
        DaytonaConnectionError,
        DaytonaError,
        DaytonaForbiddenError,
        DaytonaNotFoundError,
        DaytonaRateLimitError,
        DaytonaTimeoutError,
    )
    from daytona.common.errors import DaytonaFileNotFoundError, DaytonaGoneError

    msg = redact(str(exc), [api_key]) or type(exc).__name__
    if isinstance(exc, (DaytonaAuthenticationError, DaytonaForbiddenError)):
        return SandboxError(f"daytona: {what}: the credentials were rejected ({msg}); check DAYTONA_API_KEY")
    if isinstance(exc, DaytonaRateLimitError):
        return QuotaError(f"daytona: {what}: {msg}")
    if isinstance(exc, DaytonaFileNotFoundError):
        return FileNotFoundError(msg)
    if isinstance(exc, (DaytonaNotFoundError, DaytonaGoneError)):
        return SandboxGone(f"daytona: {what}: the sandbox no longer exists ({msg})")
    status = getattr(exc, "status_code", None)
    transient = isinstance(exc, (DaytonaTimeoutError, DaytonaConnectionError, OSError)) or (
        isinstance(exc, DaytonaError) and isinstance(status, int) and status >= 500
    )
    if transient:
        return StreamLost(f"daytona: {what}: {msg}") if dispatched else TransientError(f"daytona: {what}: {msg}")
    return SandboxError(f"daytona: {what}: {msg}")


class DaytonaTransport:
    def __init__(self, sandbox: Any, *, api_key: str) -> None:
        self.sandbox = sandbox  # daytona.AsyncSandbox
        self.api_key = api_key

    async def run_script(self, script: str, *, timeout_s: float) -> str:
        try:
            response = await self.sandbox.process.exec("sh -c " + shlex.quote(script), timeout=math.ceil(timeout_s))
        except Exception as exc:
            raise classify(exc, what="running a command", api_key=self.api_key, dispatched=True) from exc
        if response.exit_code not in (0, None):  # the wrapper exits 0; this is the shell failing
            raise SandboxError(f"daytona: the shell failed (exit {response.exit_code}): {response.result.strip()[-300:]}")
        return response.result or ""

    async def put_file(self, path: str, data: bytes) -> None:
        try:
            await self.sandbox.fs.upload_file(data, path)
        except Exception as exc:
            raise classify(exc, what=f"writing {path}", api_key=self.api_key) from exc

    async def get_file(self, path: str) -> bytes:
        try:
            return bytes(await self.sandbox.fs.download_file(path))
        except Exception as exc:
            raise classify(exc, what=f"reading {path}", api_key=self.api_key) from exc

    async def is_alive(self) -> bool:
        try:
            await self.sandbox.refresh_data()
        except Exception as exc:
            err = classify(exc, what="checking the sandbox", api_key=self.api_key)
            if isinstance(err, SandboxGone):
                return False
            raise err from exc
        return str(getattr(self.sandbox.state, "value", self.sandbox.state)) == "started"

    async def destroy(self) -> None:
        try:
            await self.sandbox.delete()
        except Exception as exc:
            err = classify(exc, what="deleting the sandbox", api_key=self.api_key)
            if not isinstance(err, SandboxGone):
                raise err from exc

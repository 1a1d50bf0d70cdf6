"""What a remote provider adapter implements (:class:`Transport`), the errors it raises, and
the exec settings every remote adapter embeds in its options.

:class:`~miles_engine.sandbox.remote_sandbox.RemoteSandbox` builds the whole sandbox protocol
on top of one :class:`Transport`.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from miles_engine.errors import SandboxError
from miles_engine.sandbox.protocol import DEFAULT_MAX_OUTPUT_BYTES
from miles_engine.sandbox.remote import RetryPolicy, TransientError


class StreamLost(TransientError):
    """The connection carrying a running command dropped; the command may still be running."""


class SandboxGone(SandboxError):
    """The provider says the sandbox no longer exists (killed, expired, swept)."""


class Transport(Protocol):
    """What a provider adapter supplies for one live sandbox."""

    async def run_script(self, script: str, *, timeout_s: float) -> str:
        """Run ``sh -c script`` once as root and return its stdout (the wrapper always exits 0).

        Raise :class:`~miles_engine.sandbox.remote.QuotaError` only when the provider refused
        the request (nothing ran), :class:`StreamLost` when the connection dropped after the
        request was sent, :class:`SandboxGone` when the sandbox no longer exists."""
        ...

    async def put_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` (its directory exists). Idempotent; raise
        :class:`TransientError` / :class:`~miles_engine.sandbox.remote.QuotaError` for failures
        worth retrying."""
        ...

    async def get_file(self, path: str) -> bytes:
        """The bytes of ``path``; :class:`FileNotFoundError` when it does not exist."""
        ...

    async def is_alive(self) -> bool: ...

    async def destroy(self) -> None:
        """Delete the sandbox. Idempotent: an already-gone sandbox is not an error."""
        ...


class RemoteExecOptions(BaseModel):
    """Exec and transfer settings shared by the remote adapters (embedded in their options)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default_timeout_s: float = Field(120.0, gt=0, description="exec timeout when none is given")
    kill_grace_s: float = Field(2.0, ge=0, description="SIGTERM-to-SIGKILL grace on timeout")
    max_output_bytes: int = Field(DEFAULT_MAX_OUTPUT_BYTES, gt=0, description="per-stream output cap")
    max_transfer_mb: int = Field(256, gt=0, description="cap on read_file/download_dir transfers")
    retry: RetryPolicy = Field(default_factory=RetryPolicy)

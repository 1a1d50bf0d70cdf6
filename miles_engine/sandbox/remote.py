"""Helpers shared by the remote sandbox adapters (Docker, E2B, Daytona, Modal).

- :func:`retry_idempotent` retries an *idempotent* provider call (create by a fixed name,
  file I/O, close, sweep) with exponential backoff. A command given to ``exec`` is never
  passed through it: re-dispatching a model-issued command could run it twice.
- Adapters turn provider failures into :class:`TransientError` (retry), :class:`QuotaError`
  (throttled / over quota: longer backoff, then one clear error) or any other exception
  (not retried).
- :func:`require_env` reads credentials from the providers' usual environment variables;
  a missing one is a one-line error naming it. Values are never put in messages or logs
  (:func:`redact` scrubs them out of provider error texts).
- :func:`cap_output` / :func:`read_capped` / :func:`decode_output` normalise command output
  to the protocol: per-stream byte cap with ``truncated``, UTF-8 with replacement.
- :func:`run_id_for` / :func:`sandbox_labels` give every remote sandbox its run label.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

from miles_engine.errors import SandboxError
from miles_engine.sandbox.protocol import RUN_LABEL, SANDBOX_LABEL, SandboxSpec

T = TypeVar("T")
log = logging.getLogger(__name__)

RUN_ID_ENV = "MILES_RUN_ID"
_PROCESS_RUN_ID: str | None = None


class TransientError(SandboxError):
    """A provider call failed in a way that may succeed if repeated (dropped connection,
    5xx, a name conflict of our own earlier attempt...)."""


class QuotaError(TransientError):
    """The provider throttled us or a quota is exhausted (HTTP 429, 'rate limit', 'quota')."""


class RetryPolicy(BaseModel):
    """Backoff for idempotent provider calls (an adapter's options embed it as ``retry``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempts: int = Field(4, ge=1, le=20, description="tries for a transient failure (1 = no retry)")
    quota_attempts: int = Field(6, ge=1, le=30, description="tries when the provider throttles or is over quota")
    base_delay_s: float = Field(0.5, ge=0, description="first backoff delay; doubles each retry")
    max_delay_s: float = Field(20.0, ge=0, description="cap on one backoff delay")

    def delay(self, attempt: int) -> float:
        """Delay before retry number ``attempt`` (1-based), with +-25% jitter."""
        d = min(self.max_delay_s, self.base_delay_s * (2 ** (attempt - 1)))
        return d * random.uniform(0.75, 1.25)


async def retry_idempotent(
    call: Callable[[], Awaitable[T]],
    *,
    what: str,
    policy: RetryPolicy | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> T:
    """Run ``call`` until it succeeds, retrying :class:`TransientError`/:class:`QuotaError`.

    ``call`` must be idempotent. Other exceptions pass through at once. When the tries run
    out the result is one :class:`SandboxError` naming ``what``, the number of tries and the
    last provider message.
    """
    policy = policy or RetryPolicy()
    attempt = 0
    waited = 0.0
    while True:
        attempt += 1
        try:
            return await call()
        except QuotaError as exc:
            if attempt >= policy.quota_attempts:
                raise SandboxError(
                    f"{what}: the provider is still throttling / over quota after {attempt} tries "
                    f"over {waited:.0f}s ({exc}); lower the concurrency or raise the quota"
                ) from exc
            err: TransientError = exc
        except TransientError as exc:
            if attempt >= policy.attempts:
                raise SandboxError(f"{what} failed after {attempt} tries: {exc}") from exc
            err = exc
        delay = policy.delay(attempt)
        log.info("%s: %s; retry %d in %.1fs", what, err, attempt, delay)
        waited += delay
        await sleep(delay)


def require_env(provider: str, *names: str) -> str:
    """The value of the first of ``names`` that is set (non-empty); else one error line
    naming the variable(s) to set. The value itself never appears in any message."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    alts = " (or " + ", ".join(names[1:]) + ")" if len(names) > 1 else ""
    raise SandboxError(f"{provider} sandbox: credentials missing: set the environment variable {names[0]}{alts}")


def redact(text: str, secret_values: Iterable[str | None]) -> str:
    """``text`` with every secret value replaced by ``***`` (for provider error messages)."""
    for value in secret_values:
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


# ------------------------------------------------------------------------------ output
def cap_output(data: bytes | str | None, max_bytes: int) -> tuple[bytes, bool]:
    """At most ``max_bytes`` of ``data`` (str is UTF-8 encoded) and whether it was cut."""
    if data is None:
        return b"", False
    raw = data.encode("utf-8", errors="surrogateescape") if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        return raw[:max_bytes], True
    return raw, False


def decode_output(data: bytes) -> str:
    """Command output as text: UTF-8, undecodable bytes (e.g. a multibyte char cut at the
    cap) replaced, never an exception."""
    return data.decode("utf-8", errors="replace")


def normalise_streams(stdout: bytes | str | None, stderr: bytes | str | None, max_bytes: int) -> tuple[str, str, bool]:
    """Both streams capped and decoded, plus the combined ``truncated`` flag."""
    out, t1 = cap_output(stdout, max_bytes)
    err, t2 = cap_output(stderr, max_bytes)
    return decode_output(out), decode_output(err), t1 or t2


async def read_capped(stream: asyncio.StreamReader, max_bytes: int, chunk: int = 1 << 16) -> tuple[bytes, bool]:
    """Read ``stream`` to EOF keeping the first ``max_bytes``; the rest is drained and dropped
    (so the writer never blocks on a full pipe)."""
    buf = bytearray()
    truncated = False
    while True:
        data = await stream.read(chunk)
        if not data:
            return bytes(buf), truncated
        room = max_bytes - len(buf)
        if room > 0:
            buf += data[:room]
        if len(data) > max(room, 0):
            truncated = True


# ------------------------------------------------------------------------------ labels
def process_run_id() -> str:
    """This process's run id: ``$MILES_RUN_ID`` when set, else one generated per process."""
    global _PROCESS_RUN_ID
    env = os.environ.get(RUN_ID_ENV, "").strip()
    if env:
        return env
    if _PROCESS_RUN_ID is None:
        _PROCESS_RUN_ID = "run-" + secrets.token_hex(6)
    return _PROCESS_RUN_ID


def run_id_for(spec: SandboxSpec, backend_run_id: str | None) -> str:
    """The run a sandbox belongs to: the spec's own label, else the backend's configured run
    id, else the process's (see :func:`process_run_id`)."""
    return spec.labels.get(RUN_LABEL) or backend_run_id or process_run_id()


def sandbox_labels(
    spec: SandboxSpec, *, sandbox_id: str, run_id: str, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The spec's labels plus the run and sandbox labels every remote sandbox carries."""
    return {**spec.labels, **(extra or {}), RUN_LABEL: run_id, SANDBOX_LABEL: sandbox_id}

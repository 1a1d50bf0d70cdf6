"""A readiness check run by ``exec`` in a live sandbox before the agent starts, with Docker
HEALTHCHECK's timing (as Harbor's ``[environment.healthcheck]`` runs it), on any backend.

The command runs under ``bash -c`` (each try bounded by ``timeout_s``) until it exits 0. During
``start_period_s`` (counted from the first try) failures do not count and tries are
``start_interval_s`` apart; after it, tries are ``interval_s`` apart and the ``retries``-th
consecutive failure ends the wait with :class:`~miles_engine.errors.HealthcheckError`, whose
message names the command and carries its last output.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from miles_engine.errors import HealthcheckError
from miles_engine.sandbox.protocol import ExecResult, Sandbox

OUTPUT_TAIL = 1000  # characters of the last try's output kept in the error


class Healthcheck(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    command: str = Field(min_length=1)
    interval_s: float = Field(5.0, ge=0)
    timeout_s: float = Field(30.0, gt=0)
    start_period_s: float = Field(0.0, ge=0)
    start_interval_s: float = Field(5.0, ge=0)
    retries: int = Field(3, ge=1)


@dataclass(frozen=True)
class HealthcheckOutcome:
    tries: int
    waited_s: float


def _describe(result: ExecResult, timeout_s: float) -> str:
    if result.timed_out:
        status = f"timed out after {timeout_s:g}s"
    else:
        status = f"exit code {result.exit_code}"
    output = (result.stdout + result.stderr).strip()[-OUTPUT_TAIL:]
    return f"{status}; its last output: {output}" if output else f"{status}; it printed nothing"


async def wait_healthy(sandbox: Sandbox, check: Healthcheck, *, user: str | None = None, where: str = "",
                       sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                       clock: Callable[[], float] = time.monotonic) -> HealthcheckOutcome:
    """Run ``check`` in ``sandbox`` until it passes; raise :class:`HealthcheckError` when it fails
    ``retries`` times in a row after the start period. ``where`` prefixes the error (the task)."""
    started = clock()
    start_period_end = started + check.start_period_s
    failures = tries = 0
    while True:
        in_start_period = clock() < start_period_end
        tries += 1
        result = await sandbox.exec(check.command, timeout_s=check.timeout_s,
                                    **({"user": user} if user is not None else {}))
        if result.ok:
            return HealthcheckOutcome(tries=tries, waited_s=round(clock() - started, 3))
        if in_start_period:
            await sleep(check.start_interval_s)
            continue
        failures += 1
        if failures >= check.retries:
            prefix = f"{where}: " if where else ""
            raise HealthcheckError(
                f"{prefix}healthcheck did not pass: `{check.command}` failed {failures} consecutive "
                f"time(s) after a {check.start_period_s:g}s start period ({tries} tries in all; the last: "
                f"{_describe(result, check.timeout_s)})"
            )
        await sleep(check.interval_s)

"""The sandbox's commands of one episode, as the run's trajectory record shows them: each command
the task, the agent's tools or the verifier ran, with its exit code, duration, start (seconds from
the episode's start), truncation flag and output (clipped, head and tail)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

MAX_COMMANDS = 200  # per episode: a runaway agent's commands past this are counted, not kept
MAX_CHARS = 4000  # per output; a longer one keeps its head and tail


def clip_text(text: str, limit: int = MAX_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} [... {len(text) - 2 * half} chars ...] {text[-half:]}"


class CommandLog:
    """Where commands go; ``phase`` names the part of the episode running them (setup, agent, verify)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.phase = "setup"
        self.commands: list[dict[str, Any]] = []
        self.dropped = 0

    def add(self, entry: dict[str, Any]) -> None:
        if len(self.commands) < MAX_COMMANDS:
            self.commands.append(entry)
        else:
            self.dropped += 1


def _text(cmd: str | Sequence[str]) -> str:
    return cmd if isinstance(cmd, str) else " ".join(str(a) for a in cmd)


class RecordingSandbox:
    """``sandbox`` as the episode's task and agent see it: every ``exec`` also lands in ``log``
    (the sandbox object itself is not changed: a warm pool hands it to later episodes)."""

    def __init__(self, sandbox: Any, log: CommandLog) -> None:
        self._sandbox, self._log = sandbox, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sandbox, name)

    async def exec(self, cmd: str | Sequence[str], **kwargs: Any) -> Any:
        log = self._log
        t0 = time.perf_counter()
        entry: dict[str, Any] = {"command": clip_text(_text(cmd), 2000), "phase": log.phase,
                                 "started_s": round(t0 - log.started, 6)}
        try:
            result = await self._sandbox.exec(cmd, **kwargs)
        except Exception as exc:
            entry.update(exit_code=None, duration_s=time.perf_counter() - t0, truncated=False,
                         output=f"{type(exc).__name__}: {exc}")
            log.add(entry)
            raise
        output = result.stdout + (("\n" if result.stdout else "") + result.stderr if result.stderr else "")
        entry.update(exit_code=result.exit_code, duration_s=result.duration_s or time.perf_counter() - t0,
                     truncated=bool(result.truncated), timed_out=bool(result.timed_out), output=clip_text(output))
        log.add(entry)
        return result

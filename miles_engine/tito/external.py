"""The external-harness agent (``tito-external``): run any command-line agent against its own
session, then collect the session's trajectories.

The command runs on the host (it must reach the session server), in its own process group,
with ``OPENAI_BASE_URL`` (the session's ``…/v1``), ``OPENAI_API_KEY``, ``MILES_SESSION_ID``,
``MILES_TASK_ID``, ``MILES_TASK_PROMPT`` (the task's user text) and ``MILES_TASK_MESSAGES``
(JSON) in its environment. ``{prompt}``, ``{base_url}`` and ``{session_id}`` in the command are
replaced. The harness's last assistant message is recorded as the episode's answer. Tools the
harness runs are its own: they do not go through the task's sandbox.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import time
from typing import Any, Literal

from pydantic import Field

from miles_engine.components import Section
from miles_engine.agents.protocol import AgentResult
from miles_engine.environments.protocol import EpisodeContext
from miles_engine.tito.agent import collect_into
from miles_engine.tito.client import SessionClient, server_url

TAIL = 4000


class ExternalAgentOptions(Section):
    command: list[str] | str = Field(..., description="argv list, or a string split with shlex")
    server_url: str | None = None
    api_key: str = "miles"
    mode: Literal["linear", "branching"] = "linear"
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    timeout_s: float | None = Field(None, gt=0, description="default: the task's agent timeout minus 5%")
    keep_session: bool = False


def _prompt_text(messages: list[dict[str, Any]]) -> str:
    return "\n\n".join(str(m.get("content") or "") for m in messages if m.get("role") == "user")


async def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    await proc.wait()


class ExternalHarnessAgent:
    name = "tito-external"

    def __init__(self, options: ExternalAgentOptions) -> None:
        self.options = options

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        o = self.options
        client = SessionClient(server_url(o.server_url), api_key=o.api_key, use_openai=False)
        stop, info, started = "done", {}, time.monotonic()
        proc = None
        try:
            await client.open(mode=o.mode, metadata={"task_id": ctx.task.id, "agent": self.name})
            messages = ctx.task.prompt()
            prompt = _prompt_text(messages)
            fill = {"prompt": prompt, "base_url": client.base_url, "session_id": client.session_id}
            argv = shlex.split(o.command) if isinstance(o.command, str) else list(o.command)
            argv = [a.format(**fill) if "{" in a else a for a in argv]
            env = {**os.environ, **o.env, "OPENAI_BASE_URL": client.base_url, "OPENAI_API_KEY": o.api_key,
                   "MILES_SESSION_ID": client.session_id, "MILES_TASK_ID": ctx.task.id,
                   "MILES_TASK_PROMPT": prompt, "MILES_TASK_MESSAGES": json.dumps(messages)}
            proc = await asyncio.create_subprocess_exec(
                *argv, cwd=o.cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
            timeout = o.timeout_s or ctx.task.limits.agent_timeout_s * 0.95
            try:
                out, err = await asyncio.wait_for(proc.communicate(), timeout)
            except TimeoutError:
                stop = "timeout"
                await _kill(proc)
                out, err = b"", b""
            info.update(exit_code=proc.returncode, stdout_tail=out.decode(errors="replace")[-TAIL:],
                        stderr_tail=err.decode(errors="replace")[-TAIL:], wall_s=round(time.monotonic() - started, 3))
            if stop == "done" and proc.returncode:
                stop = "error"
                info["error"] = f"harness exited with status {proc.returncode}"
        except Exception as exc:
            stop = "error"
            info["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if proc is not None:
                await asyncio.shield(_kill(proc))
            report = await collect_into(ctx, client, o.keep_session)
        trajectories = report.get("trajectories", [])
        turns = sum(len(t["turns"]) for t in trajectories)
        if trajectories:
            last = [m for m in trajectories[-1]["messages"] if m["role"] == "assistant"]
            if last and not last[-1].get("tool_calls"):
                ctx.say(last[-1]["content"])
        info.update(session_id=report.get("session_id"), trajectories=trajectories,
                    tito_metrics=report.get("metrics", {}))
        return AgentResult(turns=turns, stop_reason=stop, info=info)

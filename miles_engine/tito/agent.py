"""The model-driven agent (``tito``): multi-turn tool calling through a session server's
OpenAI API, over HTTP, exactly as an external harness would.

Each turn the model sees the task's messages and tools; each tool call runs through
``ctx.call_tool`` (the task's sandbox), and its output goes back as a ``tool`` message. When
the model answers without a tool call the task may continue the conversation with a next user
message (``ctx.next_turn()``: a multi-step task's next instruction); otherwise the episode
ends, as it does at ``max_turns`` or at the agent deadline. The session's trajectories are then
collected into ``AgentResult.info`` and ``ctx.info["tito"]`` (also when the episode runner's
timeout cancels the agent).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal

from pydantic import Field

from miles_engine.components import Section
from miles_engine.agents.protocol import AgentResult
from miles_engine.environments.protocol import EpisodeContext
from miles_engine.tito.client import SessionClient, server_url

COLLECT_TIMEOUT_S = 30.0


class TitoAgentOptions(Section):
    server_url: str | None = Field(None, description="session server root URL (default: $MILES_TITO_URL)")
    api_key: str = "miles"
    mode: Literal["linear", "branching"] = "linear"
    max_turns: int | None = Field(None, ge=1, description="default: the task's limits.max_turns")
    timeout_s: float | None = Field(None, gt=0, description="default: the task's agent timeout minus 5%")
    request_timeout_s: float = Field(600.0, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    enable_thinking: bool | None = None
    client: Literal["auto", "openai", "httpx", "aiohttp", "local"] = Field(
        "auto", description="auto/openai: the official openai SDK; httpx/aiohttp: the same OpenAI wire format "
        "over a plain pooled HTTP client (aiohttp is the fast path for many concurrent episodes); local: "
        "requests go straight to the session server's app when it runs in this process (same routes and "
        "checks, no socket), else over aiohttp")
    keep_session: bool = Field(False, description="leave the session on the server after collecting it")


async def collect_into(ctx: EpisodeContext, client: SessionClient, keep: bool) -> dict[str, Any]:
    """Fetch the session's trajectories into ``ctx.info["tito"]`` and close the session."""
    report: dict[str, Any] = {"session_id": client.session_id, "trajectories": [], "metrics": {}}
    try:
        if client.session_id:
            fetch = client.collect() if keep else client.collect_and_close()
            report = await asyncio.wait_for(fetch, COLLECT_TIMEOUT_S)
    except Exception as exc:
        report["error"] = f"could not collect trajectories: {type(exc).__name__}: {exc}"
    finally:
        try:
            await asyncio.wait_for(client.close(delete=not keep), COLLECT_TIMEOUT_S)
        except Exception:
            pass
    ctx.info["tito"] = report
    return report


class TitoAgent:
    name = "tito"

    def __init__(self, options: TitoAgentOptions | None = None) -> None:
        self.options = options or TitoAgentOptions()

    def _client(self) -> SessionClient:
        o = self.options
        use_openai = {"auto": None, "openai": True}.get(o.client, False)
        transport = o.client if o.client in ("aiohttp", "local") else "httpx"
        return SessionClient(server_url(o.server_url), api_key=o.api_key, timeout_s=o.request_timeout_s,
                             use_openai=use_openai, transport=transport)

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        o = self.options
        limits = ctx.task.limits
        max_turns = o.max_turns or limits.max_turns
        deadline = time.monotonic() + (o.timeout_s or limits.agent_timeout_s * 0.95)
        client = self._client()
        turns, stop, info = 0, "done", {}
        try:
            await client.open(mode=o.mode, metadata={"task_id": ctx.task.id, "agent": self.name})
            messages: list[dict[str, Any]] = [dict(m) for m in ctx.task.prompt()]
            ctx.info["messages"] = messages  # the conversation as this agent saw it (the run's trajectory record)
            tools = [t.openai_schema() for t in ctx.task.tools()] or None
            params = {"tools": tools, "temperature": o.temperature, "top_p": o.top_p, "max_tokens": o.max_tokens,
                      "chat_template_kwargs": {"enable_thinking": o.enable_thinking}
                      if o.enable_thinking is not None else None}
            while True:
                if turns >= max_turns:
                    stop = "max_turns"
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    stop = "timeout"
                    break
                reply = await asyncio.wait_for(client.chat(messages, **params), remaining)
                turns += 1
                messages.append(reply)
                calls = reply.get("tool_calls") or []
                if not calls:
                    ctx.say(reply.get("content") or "")
                    follow = await ctx.next_turn()  # a multi-step task's next instruction
                    if not follow:
                        break
                    messages.extend(dict(m) for m in follow)
                    continue
                for call in calls:
                    fn = call.get("function") or {}
                    try:
                        args = json.loads(fn.get("arguments") or "{}")
                    except ValueError:
                        args = None
                    if not isinstance(args, dict):
                        content = "error: tool arguments must be a JSON object"
                    else:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            raise TimeoutError
                        content = (await asyncio.wait_for(ctx.call_tool(fn.get("name", ""), args), remaining)).content
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
        except TimeoutError:
            stop = "timeout"
        except Exception as exc:
            stop, info = "error", {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            report = await collect_into(ctx, client, o.keep_session)
        info.update(session_id=report.get("session_id"), trajectories=report.get("trajectories", []),
                    tito_metrics=report.get("metrics", {}))
        if report.get("error"):
            info["collect_error"] = report["error"]
        return AgentResult(turns=turns, stop_reason=stop, info=info)

"""Test helpers: serve an ASGI app with uvicorn on 127.0.0.1 in a thread; a bisecting scripted agent."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from miles_engine.agents.protocol import AgentResult
from miles_engine.environments.protocol import EpisodeContext


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serve(app: Any, timeout_s: float = 30.0) -> Iterator[str]:
    """Run ``app`` on a free 127.0.0.1 port for the duration of the block; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test OpenEnv server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout_s)


class BisectingAgent:
    """Plays the guessing game through the task's tool by bisection (reads each observation's hint)."""

    name = "bisect"

    def __init__(self, tool: str = "step", max_steps: int = 6) -> None:
        self.tool = tool
        self.max_steps = max_steps
        self.outputs: list[str] = []

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        low, high, steps = 0, 9, 0
        while steps < self.max_steps and low <= high:
            guess = (low + high) // 2
            result = await ctx.call_tool(self.tool, {"guess": guess})
            steps += 1
            self.outputs.append(result.content)
            if result.is_error:
                break
            hint = json.loads(result.content.splitlines()[0])["hint"]
            if hint == "correct" or "done:" in result.content:
                break
            low, high = (guess + 1, high) if hint == "higher" else (low, guess - 1)
        ctx.say("finished")
        return AgentResult(turns=steps)


class FixedAgent:
    """Calls the tool with fixed argument dicts, recording each result."""

    name = "fixed"

    def __init__(self, *calls: dict[str, Any], tool: str = "step") -> None:
        self.calls = calls
        self.tool = tool
        self.results: list[Any] = []

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        for args in self.calls:
            self.results.append(await ctx.call_tool(self.tool, args))
        return AgentResult(turns=len(self.calls))

"""Shared helpers for the TITO tests: scripted model outputs per family, servers, checks."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import httpx

from miles_engine.tito.check_engine import verify_trajectory
from miles_engine.tito.families.base import ChatCodec
from miles_engine.tito.server import create_app
from miles_engine.tito.service import SessionManager, SessionServerConfig
from miles_engine.engines.scripted import ScriptedEngine

BASH = {"type": "function", "function": {
    "name": "bash", "description": "Run a bash command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


def sampled_text(family: str, *, content: str = "", reasoning: str | None = None, command: str | None = None,
                 thinking: bool = True) -> str:
    """What a well-behaved model of ``family`` samples for one turn, stop token included."""
    if family == "glm":
        out = ""
        if thinking and reasoning is not None:
            out += f"\n<think>{reasoning}</think>"
        if content:
            out += "\n" + content
        if command is not None:
            out += f"\n<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>{command}</arg_value>\n</tool_call>"
            return out + "<|observation|>"
        return out + "<|user|>"
    out = ""
    if family == "qwen3" and thinking and reasoning is not None:
        out += f"<think>\n{reasoning}\n</think>\n\n"
    out += content
    if command is not None:
        call = json.dumps({"name": "bash", "arguments": {"command": command}})
        out += ("\n" if content else "") + f"<tool_call>\n{call}\n</tool_call>"
    return out + "<|im_end|>"


class Scripts:
    """Per-session queues of scripted outputs for a :class:`ScriptedEngine`."""

    def __init__(self) -> None:
        self.queues: dict[str | None, list[str]] = defaultdict(list)
        self.default: list[str] = []

    def add(self, session_id: str | None, *texts: str) -> None:
        self.queues[session_id].extend(texts)

    def __call__(self, _ids: Any, request: Any) -> str:
        queue = self.queues.get(request.session_id) or self.default
        if not queue:
            raise AssertionError(f"no scripted output left for session {request.session_id}")
        return queue.pop(0)


def make_server(codec: ChatCodec, *, delay_s: float = 0.0, routed_shape: tuple[int, int] | None = None,
                **config: Any) -> tuple[SessionManager, ScriptedEngine, Scripts]:
    scripts = Scripts()
    engine = ScriptedEngine(codec.tokenizer, scripts, delay_s=delay_s, routed_shape=routed_shape)
    return SessionManager(engine, codec, SessionServerConfig(**config)), engine, scripts


def asgi(manager: SessionManager) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(manager)), base_url="http://tito")


def assert_exact(report: dict[str, Any], engine: ScriptedEngine, session_id: str) -> None:
    """Every trajectory: sampled spans are the engine's outputs verbatim, each turn's prompt is
    the row before it, env tokens carry mask 0, and no special/non-assistant mismatch."""
    records = [(list(r.input_ids), res) for r, res in zip(engine.requests, engine.results)
               if r.session_id == session_id]
    assert report["trajectories"], "no trajectory"
    for traj in report["trajectories"]:
        problems = verify_trajectory(traj, records)
        assert not problems, problems
        diag = traj["tito_session_mismatch"]
        assert not diag["bug"], diag
        assert diag["counts"]["non_assistant_text"] == 0

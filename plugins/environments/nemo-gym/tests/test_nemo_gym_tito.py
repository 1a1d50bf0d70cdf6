"""The ``tito`` agent (the one training uses) drives a NeMo Gym row through the TITO session
server: a scripted engine samples the tool calls, the calls go to the resources server, the
verify reward comes back, and the session yields one exact token trajectory."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from miles_engine.rollout.episode import run_episode  # noqa: E402
from miles_engine.tito.agent import TitoAgent, TitoAgentOptions  # noqa: E402
from miles_engine.tito.families import ChatMLFamily  # noqa: E402
from miles_engine.tito.server import serve_in_thread  # noqa: E402
from miles_engine.tito.service import SessionManager, SessionServerConfig  # noqa: E402
from miles_engine.engines.scripted import ScriptedEngine  # noqa: E402
from miles_engine.models.tokenizer import load_tokenizer  # noqa: E402
from miles_env_nemo_gym import NemoGymOptions, NemoGymSource  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call><|im_end|>"


def test_tito_agent_earns_the_verify_reward(resources_url, rows_file):
    codec = ChatMLFamily().bind(load_tokenizer("builtin:bpe-chatml"))
    turns = [call("get_secret", {}), call("multiply", {"a": 5, "b": 7}), "35<|im_end|>"]
    engine = ScriptedEngine(codec.tokenizer, lambda _ids, _req: turns.pop(0))
    manager = SessionManager(engine, codec, SessionServerConfig())
    source = NemoGymSource(NemoGymOptions(url=resources_url, jsonl=str(rows_file)))
    with serve_in_thread(manager) as url:
        agent = TitoAgent(TitoAgentOptions(server_url=url, client="httpx"))
        result = asyncio.run(run_episode(source.load_task("row-000002"), agent, None))  # secret 5, factor 7
    assert result.reward.reward == 1.0, (result.to_dict(), result.agent.info.get("error"))
    assert result.agent.stop_reason == "done" and result.agent.turns == 3
    assert not turns
    (trajectory,) = result.agent.info["trajectories"]
    assert len(trajectory["turns"]) == 3
    assert json.loads(result.transcript[1]["content"]) == {"secret": 5}

"""The ``tito`` agent (tool calling through the session server over HTTP) and the external-harness
agent, on in-memory tasks and on the packaged terminal tasks (local sandbox)."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap

import pytest

from miles_engine.environments.protocol import TaskLimits
from miles_engine.rollout.episode import run_episode
from miles_engine.tito.agent import TitoAgent, TitoAgentOptions
from miles_engine.tito.check_engine import RecordingEngine, verify_trajectory
from miles_engine.tito.external import ExternalAgentOptions, ExternalHarnessAgent
from miles_engine.tito.server import serve_in_thread
from miles_engine.tito.service import SessionManager, SessionServerConfig

from ..core.fakes import FileTask, MemoryBackend
from .helpers import assert_exact, make_server, sampled_text

LIMITS = TaskLimits(agent_timeout_s=60, verifier_timeout_s=10, max_turns=8)


def _episode(task, agent, backend):
    return asyncio.run(run_episode(task, agent, backend))


@pytest.mark.parametrize("client", ["openai", "httpx"])
def test_tito_agent_solves_a_task_through_http(codecs, client):
    if client == "openai":
        pytest.importorskip("openai")
    manager, engine, scripts = make_server(codecs["qwen3"])
    scripts.default.extend([sampled_text("qwen3", reasoning="write it", command="write /app/answer yes"),
                            sampled_text("qwen3", content="Done.", reasoning="ok")])
    with serve_in_thread(manager) as url:
        agent = TitoAgent(TitoAgentOptions(server_url=url, client=client))
        result = _episode(FileTask(limits=LIMITS), agent, MemoryBackend())
    assert result.reward.reward == 1.0, result.to_dict()
    assert result.agent.stop_reason == "done" and result.agent.turns == 2
    info = result.agent.info
    assert len(info["trajectories"]) == 1 and info["tito_metrics"]["tito_session_mismatch_rate"] == 0.0
    assert_exact({"trajectories": info["trajectories"]}, engine, engine.requests[0].session_id)
    assert not manager.sessions  # collected, then deleted
    assert result.transcript[-1] == {"role": "assistant", "content": "Done."}


class FollowUpTask(FileTask):
    """Asks once more when the model first answers (as a multi-step task gives its next instruction)."""

    async def next_turn(self, ctx):
        if ctx.info.get("followed_up"):
            return None
        ctx.info["followed_up"] = True
        return [{"role": "user", "content": "Now write it."}]


def test_tito_agent_continues_the_conversation_when_the_task_has_a_next_turn(codecs):
    manager, engine, scripts = make_server(codecs["qwen3"])
    scripts.default.extend([sampled_text("qwen3", content="Ready.", reasoning="wait"),
                            sampled_text("qwen3", reasoning="now", command="write /app/answer yes"),
                            sampled_text("qwen3", content="Done.", reasoning="ok")])
    with serve_in_thread(manager) as url:
        result = _episode(FollowUpTask(limits=LIMITS), TitoAgent(TitoAgentOptions(server_url=url, client="httpx")),
                          MemoryBackend())
    assert result.reward.reward == 1.0 and result.agent.turns == 3, result.to_dict()
    assert [m["content"] for m in result.transcript if m["role"] in ("user", "assistant") and not m.get("tool_calls")] \
        == ["Ready.", "Now write it.", "Done."]
    info = result.agent.info  # one conversation: one linear trajectory holding every turn
    assert len(info["trajectories"]) == 1 and len(info["trajectories"][0]["turns"]) == 3
    assert_exact({"trajectories": info["trajectories"]}, engine, engine.requests[0].session_id)


def test_tito_agent_stops_at_max_turns_and_timeout(codecs):
    manager, engine, scripts = make_server(codecs["chatml"])
    scripts.default.extend([sampled_text("chatml", command="echo hi")] * 10)
    with serve_in_thread(manager) as url:
        agent = TitoAgent(TitoAgentOptions(server_url=url, max_turns=3, client="httpx"))
        result = _episode(FileTask(limits=LIMITS), agent, MemoryBackend())
        assert result.agent.stop_reason == "max_turns" and result.agent.turns == 3
        assert len(result.agent.info["trajectories"][0]["turns"]) == 3
        engine.delay_s = 5.0
        agent = TitoAgent(TitoAgentOptions(server_url=url, timeout_s=0.5, client="httpx"))
        result = _episode(FileTask(limits=LIMITS), agent, MemoryBackend())
        assert result.agent.stop_reason == "timeout"
        assert result.agent.info["trajectories"] == []


def test_external_harness_agent_runs_an_openai_sdk_script(codecs, tmp_path):
    pytest.importorskip("openai")
    script = tmp_path / "harness.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        import openai
        client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY from the agent
        messages = [{"role": "user", "content": os.environ["MILES_TASK_PROMPT"]}]
        tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
        msg = client.chat.completions.create(model="m", messages=messages, tools=tools).choices[0].message
        call = msg.tool_calls[0]
        messages += [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "ran: " + call.function.arguments}]
        final = client.chat.completions.create(model="m", messages=messages, tools=tools).choices[0].message
        print("answer:", final.content, sys.argv[1])
    """))
    manager, engine, scripts = make_server(codecs["glm"])
    scripts.default.extend([sampled_text("glm", reasoning="r", command="ls"),
                            sampled_text("glm", content="all good", reasoning="r")])
    with serve_in_thread(manager) as url:
        agent = ExternalHarnessAgent(ExternalAgentOptions(
            command=[sys.executable, str(script), "{session_id}"], server_url=url, timeout_s=60))
        result = _episode(FileTask(limits=LIMITS), agent, MemoryBackend())
    info = result.agent.info
    assert result.agent.stop_reason == "done", info
    assert info["exit_code"] == 0 and "answer: all good" in info["stdout_tail"]
    assert info["session_id"] in info["stdout_tail"]
    assert result.agent.turns == 2 and len(info["trajectories"]) == 1
    assert_exact({"trajectories": info["trajectories"]}, engine, info["session_id"])
    assert result.transcript[-1]["content"] == "all good"


def test_external_harness_failure_and_timeout(codecs):
    manager, engine, scripts = make_server(codecs["chatml"])
    with serve_in_thread(manager) as url:
        failing = ExternalHarnessAgent(ExternalAgentOptions(command="false", server_url=url))
        result = _episode(FileTask(limits=LIMITS), failing, MemoryBackend())
        assert result.agent.stop_reason == "error" and result.agent.info["exit_code"] == 1
        slow = ExternalHarnessAgent(ExternalAgentOptions(command=["sleep", "30"], server_url=url, timeout_s=0.5))
        result = _episode(FileTask(limits=LIMITS), slow, MemoryBackend())
        assert result.agent.stop_reason == "timeout"


@pytest.fixture(scope="module")
def terminal_tasks():
    from miles_engine.errors import MilesError
    from miles_engine.hub import Hub

    hub = Hub()
    try:
        env = hub.create("environment", "terminal-tasks", {})
        backend = hub.create("sandbox", "local", {})
    except MilesError as exc:
        pytest.skip(f"packaged terminal tasks unavailable: {exc}")
    return env, backend


def test_packaged_terminal_task_solved_by_a_scripted_policy(codecs, terminal_tasks):
    env, backend = terminal_tasks
    manager, engine, scripts = make_server(codecs["qwen3"])
    command = "printf 'Hello, World!\\n' > /app/hello.txt && cat /app/hello.txt"
    scripts.default.extend([sampled_text("qwen3", reasoning="Write the file.", command=command),
                            sampled_text("qwen3", content="Created /app/hello.txt.", reasoning="Done.")])
    with serve_in_thread(manager) as url:
        result = _episode(env.load_task("hello-file"), TitoAgent(TitoAgentOptions(server_url=url)), backend)
    assert result.reward.reward == 1.0, result.to_dict()
    assert result.transcript[1]["content"] == "Hello, World!\n"
    assert_exact({"trajectories": result.agent.info["trajectories"]}, engine, engine.requests[0].session_id)


def test_packaged_terminal_tasks_against_the_embedded_engine(codecs, terminal_tasks):
    pytest.importorskip("torch")
    from miles_engine.models.source import fit_tiny_spec

    embedded = pytest.importorskip("miles_engine.engines.embedded")
    env, backend = terminal_tasks
    codec = codecs["chatml"]  # a small vocabulary keeps the random-init model quick to build
    engine = RecordingEngine(embedded.load_engine(fit_tiny_spec("tiny:qwen3", codec.tokenizer.vocab_size)))
    manager = SessionManager(engine, codec, SessionServerConfig(default_max_tokens=16))
    task_ids = [ref.id for ref in env.list_tasks()][:2]
    results = []
    with serve_in_thread(manager) as url:
        agent = TitoAgent(TitoAgentOptions(server_url=url, max_turns=2, max_tokens=16, client="httpx"))
        for task_id in task_ids:
            results.append(_episode(env.load_task(task_id), agent, backend))
    asyncio.run(engine.inner.aclose())
    for result in results:
        assert result.reward.error is None, result.to_dict()
        assert result.agent.stop_reason in ("done", "max_turns"), result.agent.info
        trajs = result.agent.info["trajectories"]
        sid = result.agent.info["session_id"]
        records = [(inp, res) for s, inp, res in engine.log if s == sid]
        assert len(trajs) == 1 and not verify_trajectory(trajs[0], records)
        assert json.dumps(trajs[0]["token_ids"])  # plain JSON ints

"""A black-box harness on the official ``openai`` SDK against a real HTTP session server:
tool calling over several turns, reasoning on and off, linear and branching sessions, for
qwen3 (real Qwen vocabulary), glm and chatml. Trajectory rows must be exactly the engine's
prompts and sampled ids plus the tokenized environment messages."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from miles_engine.tito.server import serve_in_thread

from .helpers import BASH, assert_exact, make_server, sampled_text

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def servers(codecs):
    """One live server per family on 127.0.0.1 (ephemeral ports)."""
    out, stack = {}, []
    for name, codec in codecs.items():
        manager, engine, scripts = make_server(codec)
        ctx = serve_in_thread(manager)
        url = ctx.__enter__()
        stack.append(ctx)
        out[name] = (url, engine, scripts)
    yield out
    for ctx in stack:
        ctx.__exit__(None, None, None)


def _client(base_url: str) -> Any:
    return openai.OpenAI(base_url=base_url, api_key="sk-test", max_retries=0, timeout=30)


def _open(url: str, mode: str) -> tuple[str, str]:
    data = httpx.post(f"{url}/sessions", json={"mode": mode}, timeout=10).json()
    return data["session_id"], data["base_url"]


def _turn(client: Any, messages: list, family: str, thinking: bool, **kw: Any) -> dict:
    extra = {"chat_template_kwargs": {"enable_thinking": thinking}} if family != "chatml" else None
    resp = client.chat.completions.create(model="policy", messages=messages, tools=[BASH], extra_body=extra,
                                          temperature=0.7, max_tokens=256, **kw)
    assert resp.object == "chat.completion" and resp.usage.completion_tokens > 0
    return resp.choices[0].message.model_dump(exclude_none=True)


def _script(family: str, thinking: bool) -> list[str]:
    r = (lambda text: text) if thinking else (lambda _text: None)
    return [
        sampled_text(family, reasoning=r("Look around first."), command="ls -la /app", thinking=thinking),
        sampled_text(family, content="Let me count.", reasoning=r("Now count."), command="wc -l /app/*.txt",
                     thinking=thinking),
        sampled_text(family, content="There are 3 files with 42 lines — done ✓", reasoning=r("Report."),
                     thinking=thinking),
        sampled_text(family, content="Glad to help.", reasoning=r("Close."), thinking=thinking),
    ]


def _run_linear_conversation(client: Any, family: str, thinking: bool, turns: int = 4) -> list[dict]:
    messages: list[dict] = [{"role": "system", "content": "You are a shell agent."},
                            {"role": "user", "content": "How many lines in /app? Ünïcode ok 日本"}]
    outputs = {"ls -la /app": "a.txt\nb.txt\nc.txt\n", "wc -l /app/*.txt": "42 total\n"}
    for _ in range(turns):
        msg = _turn(client, messages, family, thinking)
        if family != "chatml":
            assert ("reasoning_content" in msg) and (msg["reasoning_content"] == "" if not thinking else True)
        messages.append(msg)
        for call in msg.get("tool_calls") or []:
            args = json.loads(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": outputs[args["command"]]})
        if not msg.get("tool_calls"):
            messages.append({"role": "user", "content": "thanks!"})
    return messages


@pytest.mark.parametrize("name,thinking", [("qwen3", True), ("qwen3", False), ("glm", True), ("glm", False),
                                           ("chatml", True)])
def test_linear_harness_rows_are_exact(servers, name, thinking):
    url, engine, scripts = servers[name]
    sid, base_url = _open(url, "linear")
    scripts.add(sid, *_script(name, thinking))
    client = _client(base_url)
    messages = _run_linear_conversation(client, name, thinking)
    assert [m["role"] for m in messages].count("tool") == 2
    report = httpx.get(f"{url}/sessions/{sid}/trajectories", timeout=30).json()
    assert len(report["trajectories"]) == 1
    traj = report["trajectories"][0]
    assert len(traj["turns"]) == 4
    assert_exact(report, engine, sid)
    # prompt + sampled + env, nothing else: the row is the last prompt plus the last sample
    last = [(r, res) for r, res in zip(engine.requests, engine.results) if r.session_id == sid][-1]
    assert traj["token_ids"] == list(last[0].input_ids) + last[1].output_ids
    assert sum(traj["loss_mask"]) == sum(len(res.output_ids) for r, res in zip(engine.requests, engine.results)
                                         if r.session_id == sid)
    assert report["metrics"]["tito_session_mismatch_rate"] == 0.0
    assert httpx.delete(f"{url}/sessions/{sid}", timeout=10).status_code == 200


@pytest.mark.parametrize("name", ["qwen3", "glm", "chatml"])
def test_branching_harness_subagent_fork(servers, name):
    url, engine, scripts = servers[name]
    sid, base_url = _open(url, "branching")
    script = _script(name, True)
    scripts.add(sid, *script[:3], sampled_text(name, content="Sub-agent result: 42.", reasoning="Sub."))
    client = _client(base_url)
    messages = _run_linear_conversation(client, name, True, turns=3)  # main agent: 3 turns
    # a sub-agent forks after the first tool result, with its own instruction
    fork = messages[:4] + [{"role": "user", "content": "Sub-task: just count lines."}]
    sub = _turn(client, fork, name, True)
    assert "42" in (sub.get("content") or "")
    report = httpx.get(f"{url}/sessions/{sid}/trajectories", timeout=30).json()
    trajs = report["trajectories"]
    assert len(trajs) == 2
    assert_exact(report, engine, sid)
    first = [t["turns"][0] for t in trajs]
    assert [f["owned"] for f in first].count(True) == 1  # shared generation trained exactly once
    s, e = first[0]["completion_start"], first[0]["completion_end"]
    assert trajs[0]["token_ids"][:e] == trajs[1]["token_ids"][:e]
    assert sum(sum(t["loss_mask"][s:e]) for t in trajs) == e - s


def test_streaming_and_logprobs_through_the_sdk(servers):
    url, engine, scripts = servers["qwen3"]
    sid, base_url = _open(url, "linear")
    scripts.add(sid, sampled_text("qwen3", content="Checking.", reasoning="think", command="ls"),
                sampled_text("qwen3", content="Done.", reasoning="ok"))
    client = _client(base_url)
    messages = [{"role": "user", "content": "list"}]
    stream = client.chat.completions.create(model="policy", messages=messages, tools=[BASH], stream=True,
                                            stream_options={"include_usage": True})
    content, calls, finish, usage = "", {}, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert content == "Checking." and finish == "tool_calls" and usage.completion_tokens > 0
    call = calls[0]
    assert call["name"] == "bash" and json.loads(call["arguments"]) == {"command": "ls"}
    messages += [{"role": "assistant", "content": content, "reasoning_content": "think",
                  "tool_calls": [{"id": call["id"], "type": "function",
                                  "function": {"name": "bash", "arguments": call["arguments"]}}]},
                 {"role": "tool", "tool_call_id": call["id"], "content": "x"}]
    resp = client.chat.completions.create(model="policy", messages=messages, tools=[BASH], logprobs=True)
    assert resp.choices[0].logprobs.content and resp.choices[0].message.content == "Done."
    report = httpx.get(f"{url}/sessions/{sid}/trajectories", timeout=30).json()
    assert_exact(report, engine, sid)
    assert len(report["trajectories"][0]["turns"]) == 2
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="policy", messages=messages, extra_body={"input_ids": [1, 2, 3]})
    with pytest.raises(openai.NotFoundError):
        _client(base_url.replace(sid, "nope")).chat.completions.create(model="policy", messages=messages)

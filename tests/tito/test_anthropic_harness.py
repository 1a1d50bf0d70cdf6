"""The official ``anthropic`` SDK against a real HTTP session server (scripted engine): Messages
turns with tool_use / tool_result blocks, thinking, streaming and not, count_tokens. One linear
session gives one exact trajectory whose loss mask sums to the output tokens the API reported."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from miles_engine.tito.server import serve_in_thread

from .helpers import assert_exact, make_server, sampled_text

anthropic = pytest.importorskip("anthropic")

BASH_TOOL = {"name": "bash", "description": "Run a bash command.",
             "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
OUTPUTS = {"ls -la /app": "a.txt\nb.txt\n", "wc -l /app/*.txt": "42 total\n"}


@pytest.fixture(scope="module")
def servers(codecs):
    out, stack = {}, []
    for name in ("qwen3", "glm"):
        manager, engine, scripts = make_server(codecs[name])
        ctx = serve_in_thread(manager)
        stack.append(ctx)
        out[name] = (ctx.__enter__(), engine, scripts)
    yield out
    for ctx in stack:
        ctx.__exit__(None, None, None)


def _open(url: str) -> tuple[str, Any]:
    sid = httpx.post(f"{url}/sessions", json={"mode": "linear"}, timeout=10).json()["session_id"]
    return sid, anthropic.Anthropic(base_url=f"{url}/sessions/{sid}", api_key="sk-test", max_retries=0, timeout=30)


def _script(family: str) -> list[str]:
    return [sampled_text(family, reasoning="Look first.", command="ls -la /app"),
            sampled_text(family, content="Counting now.", reasoning="Count.", command="wc -l /app/*.txt"),
            sampled_text(family, content="3 files, 42 lines ✓", reasoning="Report.")]


def _turn(client: Any, messages: list, stream: bool) -> Any:
    kw = dict(model="policy", max_tokens=256, system=[{"type": "text", "text": "You are a shell agent.",
                                                      "cache_control": {"type": "ephemeral"}}],
              messages=messages, tools=[BASH_TOOL], thinking={"type": "enabled", "budget_tokens": 128})
    if stream:
        with client.messages.stream(**kw) as s:
            kinds = [e.type for e in s]
            msg = s.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
        return msg
    return client.messages.create(**kw)


@pytest.mark.parametrize("family", ["qwen3", "glm"])
def test_messages_tool_loop_is_exact(servers, family):
    url, engine, scripts = servers[family]
    sid, client = _open(url)
    scripts.add(sid, *_script(family))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "How many lines in /app? 日本"}]
    output_tokens, stops = 0, []
    for i in range(3):
        if i == 2:  # count_tokens sees exactly the prompt the next turn sends
            counted = client.messages.count_tokens(model="policy", messages=messages, tools=[BASH_TOOL],
                                                   system="You are a shell agent.",
                                                   thinking={"type": "enabled", "budget_tokens": 128})
        msg = _turn(client, messages, stream=i % 2 == 1)
        if i == 2:
            assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
        output_tokens += msg.usage.output_tokens
        stops.append(msg.stop_reason)
        blocks = [b.model_dump(exclude_none=True) for b in msg.content]
        assert blocks[0]["type"] == "thinking" and blocks[0]["thinking"]
        messages.append({"role": "assistant", "content": blocks})
        results = [{"type": "tool_result", "tool_use_id": b["id"], "content": OUTPUTS[b["input"]["command"]]}
                   for b in blocks if b["type"] == "tool_use"]
        if results:
            messages.append({"role": "user", "content": results})
    assert stops == ["tool_use", "tool_use", "end_turn"]
    assert [b["text"] for b in messages[-1]["content"] if b["type"] == "text"] == ["3 files, 42 lines ✓"]
    assert msg.usage.cache_read_input_tokens > 0
    report = httpx.get(f"{url}/sessions/{sid}/trajectories", timeout=10).json()
    assert len(report["trajectories"]) == 1
    traj = report["trajectories"][0]
    assert len(traj["turns"]) == 3
    assert sum(traj["loss_mask"]) == output_tokens
    assert_exact(report, engine, sid)
    tool_msgs = [m for m in traj["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in tool_msgs] == list(OUTPUTS.values())


def test_messages_thinking_disabled_and_stop_sequence(servers):
    url, engine, scripts = servers["qwen3"]
    sid, client = _open(url)
    scripts.add(sid, sampled_text("qwen3", content="alpha STOP beta", thinking=False))
    msg = client.messages.create(model="p", max_tokens=64, messages=[{"role": "user", "content": "go"}],
                                 thinking={"type": "disabled"}, stop_sequences=["STOP"])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "STOP"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "alpha "
    assert engine.requests[-1].input_ids[-4:] == engine.tokenizer.encode("<think>\n\n</think>\n\n")[-4:]
    report = httpx.delete(f"{url}/sessions/{sid}?trajectories=true", timeout=10).json()
    assert sum(report["trajectories"][0]["loss_mask"]) == msg.usage.output_tokens


def test_messages_errors_use_anthropic_shape(servers):
    url, _engine, scripts = servers["qwen3"]
    sid, client = _open(url)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="p", max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}])
    body = err.value.body
    assert body["type"] == "error" and body["error"]["param"] == "messages[0].content[0].type"
    assert "image" in body["error"]["message"]
    scripts.add(sid, sampled_text("qwen3", content="fine", reasoning="r"))
    ok = client.messages.create(model="p", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    assert ok.content[-1].text == "fine"
    raw = httpx.post(f"{url}/sessions/{sid}/v1/messages", timeout=10,
                     content=json.dumps({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
                                         "input_ids": [1, 2]}))
    assert raw.status_code == 400 and "owns the token row" in raw.json()["error"]["message"]

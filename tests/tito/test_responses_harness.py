"""The ``openai`` SDK's ``responses`` client against a real HTTP session server (scripted
engine): function_call / function_call_output items replayed statelessly (as Codex does) and
chained with previous_response_id, streaming and not. One linear session gives one exact
trajectory whose loss mask sums to the output tokens the API reported."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from miles_engine.tito.server import serve_in_thread

from .helpers import assert_exact, make_server, sampled_text

openai = pytest.importorskip("openai")

BASH_FN = {"type": "function", "name": "bash", "description": "Run a bash command.", "strict": False,
           "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
OUTPUTS = {"ls -la /app": "a.txt\nb.txt\n", "wc -l /app/*.txt": "42 total\n"}


@pytest.fixture(scope="module")
def server(codecs):
    manager, engine, scripts = make_server(codecs["qwen3"])
    with serve_in_thread(manager) as url:
        yield url, engine, scripts


def _open(url: str) -> tuple[str, Any]:
    sid = httpx.post(f"{url}/sessions", json={"mode": "linear"}, timeout=10).json()["session_id"]
    return sid, openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="sk-test", max_retries=0, timeout=30)


def _script() -> list[str]:
    return [sampled_text("qwen3", reasoning="Look first.", command="ls -la /app"),
            sampled_text("qwen3", content="Counting now.", reasoning="Count.", command="wc -l /app/*.txt"),
            sampled_text("qwen3", content="3 files, 42 lines ✓", reasoning="Report.")]


def _create(client: Any, stream: bool, **kw: Any) -> Any:
    kw = dict(model="policy", tools=[BASH_FN], max_output_tokens=256, reasoning={"effort": "medium"}, **kw)
    if not stream:
        return client.responses.create(**kw)
    with client.responses.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    return final


def _outputs(resp: Any) -> list[dict[str, Any]]:
    return [{"type": "function_call_output", "call_id": it.call_id,
             "output": OUTPUTS[json.loads(it.arguments)["command"]]}
            for it in resp.output if it.type == "function_call"]


@pytest.mark.parametrize("chained", [False, True], ids=["stateless", "previous_response_id"])
def test_responses_tool_loop_is_exact(server, chained):
    url, engine, scripts = server
    sid, client = _open(url)
    scripts.add(sid, *_script())
    items: list[Any] = [{"role": "user", "content": "How many lines in /app? 日本"}]
    output_tokens, resp = 0, None
    for i in range(3):
        if chained and resp is not None:
            resp = _create(client, i % 2 == 1, input=_outputs(resp), previous_response_id=resp.id)
        else:
            resp = _create(client, i % 2 == 1, input=items, instructions="You are a shell agent.")
        output_tokens += resp.usage.output_tokens
        assert resp.output[0].type == "reasoning"
        items += [it.model_dump(exclude_none=True) for it in resp.output] + _outputs(resp)
    assert resp.status == "completed" and resp.output_text == "3 files, 42 lines ✓"
    assert resp.usage.input_tokens_details.cached_tokens > 0
    report = httpx.delete(f"{url}/sessions/{sid}?trajectories=true", timeout=10).json()
    assert len(report["trajectories"]) == 1
    traj = report["trajectories"][0]
    assert len(traj["turns"]) == 3 and sum(traj["loss_mask"]) == output_tokens
    assert [m["content"] for m in traj["messages"] if m["role"] == "tool"] == list(OUTPUTS.values())
    assert_exact(report, engine, sid)


def test_responses_bad_requests_leave_the_session_usable(server):
    url, _engine, scripts = server
    sid, client = _open(url)
    cases = [
        ({"input": [{"type": "computer_call", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "call_nobody", "output": "x"}]}, "input[0].call_id"),
        ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"input": "hi", "tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": "x", "token_ids": [1]}]}, "input[0].token_ids"),
        ({"input": "hi", "prompt_token_ids": [1]}, "prompt_token_ids"),
    ]
    for body, param in cases:
        r = httpx.post(f"{url}/sessions/{sid}/v1/responses", json={"model": "p", **body}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text)
        assert param.split(".")[-1].split("[")[0] in r.json()["error"]["message"] or param in r.json()["error"]["message"]
    scripts.add(sid, sampled_text("qwen3", content="fine", reasoning="r"))
    assert client.responses.create(model="p", input="hi", max_output_tokens=64).output_text == "fine"

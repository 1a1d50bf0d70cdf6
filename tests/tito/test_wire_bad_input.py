"""Bad requests on every wire route (chat completions, Messages, Responses): an unknown block
or item type, an answer to a tool call nobody made, an oversized body or prompt, client token
ids. Each is a 4xx naming the field, nothing reaches the engine, the stored row is unchanged,
and the session serves the next good request."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from .helpers import BASH, asgi, make_server, sampled_text

LONG = "lorem ipsum dolor sit amet " * 120  # ~3 KB: over max_prompt_tokens, under max_request_bytes
HUGE = "x" * 20_000  # over max_request_bytes
TOOL = {"name": "bash", "input_schema": BASH["function"]["parameters"]}
RESP_TOOL = {"type": "function", "name": "bash", "parameters": BASH["function"]["parameters"]}


def _chat(first: dict[str, Any] | None) -> tuple[str, dict[str, Any], list[tuple[Any, int, str]]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "list"}]
    if first is None:
        return "chat/completions", {"messages": msgs, "tools": [BASH]}, []
    asst = first["choices"][0]["message"]
    call = asst["tool_calls"][0]["id"]
    good = msgs + [asst, {"role": "tool", "tool_call_id": call, "content": "file.txt"}]
    body = {"tools": [BASH]}
    return "chat/completions", {**body, "messages": good}, [
        ({**body, "messages": good[:2] + [{"role": "user", "content": [{"type": "video", "x": 1}]}]}, 400,
         "messages[2].content[0]"),
        ({**body, "messages": good[:2] + [{"role": "tool", "tool_call_id": "call_nobody", "content": "x"}]}, 400,
         "messages[2].tool_call_id"),
        ({**body, "messages": good + [{"role": "user", "content": HUGE}]}, 413, "body"),
        ({**body, "messages": good + [{"role": "user", "content": LONG}]}, 400, "messages"),
        ({**body, "messages": good, "input_ids": [1, 2]}, 400, "input_ids"),
    ]


def _messages(first: dict[str, Any] | None) -> tuple[str, dict[str, Any], list[tuple[Any, int, str]]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "list"}]
    body = {"max_tokens": 64, "tools": [TOOL]}
    if first is None:
        return "messages", {**body, "messages": msgs}, []
    asst = {"role": "assistant", "content": first["content"]}
    call = next(b["id"] for b in first["content"] if b["type"] == "tool_use")
    good = msgs + [asst, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call,
                                                        "content": "file.txt"}]}]
    return "messages", {**body, "messages": good}, [
        ({**body, "messages": good[:2] + [{"role": "user", "content": [{"type": "hologram"}]}]}, 400,
         "messages[2].content[0].type"),
        ({**body, "messages": good[:2] + [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_nobody", "content": "x"}]}]}, 400,
         "messages[2].content[0].tool_use_id"),
        ({**body, "messages": good + [{"role": "assistant", "content": [{"type": "mystery"}]},
                                      {"role": "user", "content": "x"}]}, 400, "messages[3].content[0].type"),
        ({**body, "messages": good + [{"role": "user", "content": HUGE}]}, 413, "body"),
        ({**body, "messages": good + [{"role": "user", "content": LONG}]}, 400, "messages"),
        ({**body, "messages": good, "prompt_token_ids": [1]}, 400, "prompt_token_ids"),
        ({**body, "messages": [{**good[0], "content": [{"type": "text", "text": "list", "token_ids": [3]}]},
                               *good[1:]]}, 400, "messages[0].content[0].token_ids"),
    ]


def _responses(first: dict[str, Any] | None) -> tuple[str, dict[str, Any], list[tuple[Any, int, str]]]:
    items: list[dict[str, Any]] = [{"role": "user", "content": "list"}]
    body = {"tools": [RESP_TOOL], "max_output_tokens": 64}
    if first is None:
        return "responses", {**body, "input": items}, []
    out = first["output"]
    call = next(it["call_id"] for it in out if it["type"] == "function_call")
    good = items + out + [{"type": "function_call_output", "call_id": call, "output": "file.txt"}]
    n = len(items) + len(out)
    return "responses", {**body, "input": good}, [
        ({**body, "input": good[:n] + [{"type": "teleport"}]}, 400, f"input[{n}].type"),
        ({**body, "input": good[:n] + [{"type": "function_call_output", "call_id": "call_nobody", "output": "x"}]},
         400, f"input[{n}].call_id"),
        ({**body, "input": good + [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
         f"input[{n + 1}].content[0].type"),
        ({**body, "input": good + [{"role": "user", "content": HUGE}]}, 413, "body"),
        ({**body, "input": good + [{"role": "user", "content": LONG}]}, 400, "messages"),
        ({**body, "input": good, "output_ids": [5]}, 400, "output_ids"),
    ]


@pytest.mark.parametrize("route", [_chat, _messages, _responses], ids=["chat", "messages", "responses"])
def test_bad_requests_on_each_route(codecs, route):
    manager, engine, scripts = make_server(codecs["qwen3"], max_request_bytes=16384, max_prompt_tokens=300)

    async def run():
        async with asgi(manager) as c:
            sid = (await c.post("/sessions")).json()["session_id"]
            scripts.add(sid, sampled_text("qwen3", reasoning="r", command="ls"), sampled_text("qwen3", content="ok"))
            path, first_body, _ = route(None)
            r = await c.post(f"/sessions/{sid}/v1/{path}", json=first_body)
            assert r.status_code == 200, r.text
            _, good, bad = route(r.json())
            before = (await c.get(f"/sessions/{sid}/trajectories")).json()
            calls = len(engine.requests)
            for body, status, param in bad:
                r = await c.post(f"/sessions/{sid}/v1/{path}", json=body)
                assert r.status_code == status, (param, r.status_code, r.text)
                err = r.json()["error"]
                assert err["param"] == param, (param, err)
                field = param.rsplit(".", 1)[-1].split("[")[0]
                assert field in err["message"] or param in err["message"], (param, err["message"])
            assert len(engine.requests) == calls  # nothing reached the engine
            assert (await c.get(f"/sessions/{sid}/trajectories")).json() == before
            r = await c.post(f"/sessions/{sid}/v1/{path}", json=good)  # the session still works
            assert r.status_code == 200, r.text
            report = (await c.get(f"/sessions/{sid}/trajectories")).json()
            assert len(report["trajectories"]) == 1 and len(report["trajectories"][0]["turns"]) == 2

    asyncio.run(run())

"""Every bad input is a clear 4xx (or 5xx for engine faults) and never changes stored state."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from miles_engine.engines.scripted import ScriptedEngine

from .helpers import BASH, asgi, make_server, sampled_text


async def _setup(client, scripts) -> tuple[str, str, list[dict[str, Any]]]:
    r = await client.post("/sessions")
    sid = r.json()["session_id"]
    url = f"/sessions/{sid}/v1/chat/completions"
    scripts.add(sid, sampled_text("qwen3", reasoning="r", command="ls"), *[sampled_text("qwen3", content="ok")] * 4)
    msgs = [{"role": "user", "content": "list"}]
    r = await client.post(url, json={"messages": msgs, "tools": [BASH]})
    assert r.status_code == 200, r.text
    a = r.json()["choices"][0]["message"]
    msgs += [a, {"role": "tool", "tool_call_id": a["tool_calls"][0]["id"], "content": "file.txt"}]
    return sid, url, msgs


def _bad_bodies(msgs: list[dict[str, Any]]) -> list[tuple[str, Any, int, str]]:
    call_id = msgs[1]["tool_calls"][0]["id"]
    non_json_args = copy.deepcopy(msgs)
    non_json_args[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    list_args = copy.deepcopy(msgs)
    list_args[1]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"
    unknown_id = copy.deepcopy(msgs)
    unknown_id[2]["tool_call_id"] = "call_nobody_made"
    token_in_message = copy.deepcopy(msgs)
    token_in_message[2]["token_ids"] = [1, 2, 3]
    base = {"tools": [BASH]}
    return [
        ("malformed JSON", b'{"messages": [', 400, "malformed JSON"),
        ("body not an object", b"[1, 2]", 400, "JSON object"),
        ("empty body", b"", 400, "empty"),
        ("no messages", {**base, "messages": []}, 400, "non-empty list"),
        ("unknown role", {**base, "messages": msgs + [{"role": "robot", "content": "x"}]}, 400, "unknown message role"),
        ("non-JSON tool args", {**base, "messages": non_json_args}, 400, "not valid JSON"),
        ("args not an object", {**base, "messages": list_args}, 400, "JSON object"),
        ("unknown tool call id", {**base, "messages": unknown_id}, 400, "call_nobody_made"),
        ("input_ids", {**base, "messages": msgs, "input_ids": [1, 2]}, 400, "owns the token row"),
        ("prompt_token_ids", {**base, "messages": msgs, "prompt_token_ids": [1]}, 400, "owns the token row"),
        ("offsets", {**base, "messages": msgs, "token_offsets": [0]}, 400, "owns the token row"),
        ("token ids in a message", {**base, "messages": token_in_message}, 400, "owns the token row"),
        ("logit_bias", {**base, "messages": msgs, "logit_bias": {"5": 10}}, 400, "logit_bias"),
        ("custom template", {**base, "messages": msgs, "chat_template": "{{ x }}"}, 400, "chat_template"),
        ("n=2", {**base, "messages": msgs, "n": 2}, 400, "'n' must be 1"),
        ("temperature", {**base, "messages": msgs, "temperature": -1}, 400, "temperature"),
        ("template kwargs", {**base, "messages": msgs, "chat_template_kwargs": {"x": 1}}, 400, "not accepted"),
        ("image part", {**base, "messages": msgs + [{"role": "user", "content": [{"type": "image_url"}]}]},
         400, "image_url"),
        ("tool without id", {**base, "messages": msgs[:2] + [{"role": "tool", "content": "x"}]}, 400, "tool_call_id"),
        ("deep divergence", {**base, "messages": [{"role": "user", "content": "other"}, msgs[1], msgs[2]]},
         409, "assistant"),
        ("rewritten assistant", {**base, "messages": [msgs[0], {**msgs[1], "content": "edited"}, msgs[2]]},
         409, "does not match"),
        ("bad tools", {"messages": msgs, "tools": [{"type": "retrieval"}]}, 400, "function tools"),
        (f"tool call {call_id} legacy function_call", {**base, "messages": msgs, "function_call": "auto"}, 400,
         "function_call"),
    ]


def test_bad_requests_are_rejected_and_state_is_unchanged(codecs):
    manager, engine, scripts = make_server(codecs["qwen3"], max_tokens_limit=64)

    async def run():
        async with asgi(manager) as c:
            sid, url, msgs = await _setup(c, scripts)
            before = (await c.get(f"/sessions/{sid}/trajectories")).json()
            calls = len(engine.requests)
            for name, body, status, needle in _bad_bodies(msgs) + [
                    ("max_tokens over limit", {"messages": msgs, "tools": [BASH], "max_tokens": 65}, 400, "limit")]:
                kw = {"content": body} if isinstance(body, bytes) else {"json": body}
                r = await c.post(url, headers={"content-type": "application/json"}, **kw)
                assert r.status_code == status, (name, r.status_code, r.text)
                err = r.json()["error"]
                assert needle in err["message"], (name, err)
                assert err["type"] and "message" in err
            assert len(engine.requests) == calls  # nothing reached the engine
            after = (await c.get(f"/sessions/{sid}/trajectories")).json()
            assert after == before
            r = await c.post(url, json={"messages": msgs, "tools": [BASH]})  # the session still works
            assert r.status_code == 200

    asyncio.run(run())


def test_unknown_and_deleted_sessions(codecs):
    manager, engine, scripts = make_server(codecs["chatml"])

    async def run():
        async with asgi(manager) as c:
            body = {"messages": [{"role": "user", "content": "hi"}]}
            r = await c.post("/sessions/nope/v1/chat/completions", json=body)
            assert r.status_code == 404 and "unknown session" in r.json()["error"]["message"]
            sid = (await c.post("/sessions")).json()["session_id"]
            assert (await c.get(f"/sessions/{sid}/v1/models")).json()["data"][0]["id"] == "miles-policy"
            assert (await c.delete(f"/sessions/{sid}")).status_code == 200
            paths = [("post", f"/sessions/{sid}/v1/chat/completions"), ("get", f"/sessions/{sid}/trajectories"),
                     ("delete", f"/sessions/{sid}")]
            for method, path in paths:
                r = await c.request(method.upper(), path, json=body if method == "post" else None)
                assert r.status_code == 404 and "was deleted" in r.json()["error"]["message"], (method, path)
            assert (await c.post("/sessions", json={"mode": "tree"})).status_code == 400
            assert (await c.post("/sessions", json={"bogus": 1})).status_code == 400
            assert (await c.get("/health")).json()["status"] == "ok"

    asyncio.run(run())


def test_concurrent_requests_on_a_linear_session_get_409(codecs):
    manager, engine, scripts = make_server(codecs["chatml"], delay_s=0.3)

    async def run():
        async with asgi(manager) as c:
            sid = (await c.post("/sessions")).json()["session_id"]
            scripts.add(sid, *[sampled_text("chatml", content="x")] * 2)
            url = f"/sessions/{sid}/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": "hi"}]}

            async def later():
                await asyncio.sleep(0.05)
                return await c.post(url, json=body)

            first, second = await asyncio.gather(c.post(url, json=body), later())
            assert first.status_code == 200
            assert second.status_code == 409 and second.json()["error"]["code"] == "session_busy"
            report = (await c.get(f"/sessions/{sid}/trajectories")).json()
            assert len(report["trajectories"][0]["turns"]) == 1

    asyncio.run(run())


def test_delete_during_generation_aborts_and_records_nothing(codecs):
    manager, engine, scripts = make_server(codecs["chatml"], delay_s=0.3)

    async def run():
        async with asgi(manager) as c:
            sid = (await c.post("/sessions")).json()["session_id"]
            scripts.add(sid, sampled_text("chatml", content="x"))
            url = f"/sessions/{sid}/v1/chat/completions"
            task = asyncio.ensure_future(c.post(url, json={"messages": [{"role": "user", "content": "hi"}]}))
            await asyncio.sleep(0.05)
            assert (await c.delete(f"/sessions/{sid}")).status_code == 200
            r = await task
            assert r.status_code == 404 and "deleted while the request was generating" in r.json()["error"]["message"]
            assert engine.aborted == [engine.requests[0].request_id]

    asyncio.run(run())


@pytest.mark.parametrize("fault,status", [("raise", 502), ("abort", 503), ("short", 502), ("refuse", 400),
                                          ("down", 503)])
def test_engine_faults_commit_nothing(codecs, fault, status):
    codec = codecs["chatml"]
    manager, engine, scripts = make_server(codec)

    async def run():
        async with asgi(manager) as c:
            sid = (await c.post("/sessions")).json()["session_id"]
            scripts.add(sid, sampled_text("chatml", content="ok"), sampled_text("chatml", content="ok"))
            url = f"/sessions/{sid}/v1/chat/completions"
            msgs = [{"role": "user", "content": "hi"}]
            a = (await c.post(url, json={"messages": msgs})).json()["choices"][0]["message"]
            before = (await c.get(f"/sessions/{sid}/trajectories")).json()
            original = engine.generate

            async def broken(request):
                if fault == "raise":
                    raise RuntimeError("GPU on fire")
                if fault == "refuse":
                    raise ValueError("prompt of 9999 tokens does not fit the context of 4096 tokens")
                if fault == "down":
                    from miles_engine.engines.errors import EngineUnavailable

                    raise EngineUnavailable("connection refused")
                result = await original(request)
                if fault == "abort":
                    result.finish_reason = "abort"
                else:
                    result.output_logprobs = result.output_logprobs[:-1]
                return result

            engine.generate = broken  # type: ignore[method-assign]
            r = await c.post(url, json={"messages": msgs + [a, {"role": "user", "content": "again"}]})
            assert r.status_code == status, r.text
            assert (await c.get(f"/sessions/{sid}/trajectories")).json() == before
            engine.generate = original  # type: ignore[method-assign]

    asyncio.run(run())


def test_glm_cannot_append_system_after_assistant(codecs):
    manager, engine, scripts = make_server(codecs["glm"])

    async def run():
        async with asgi(manager) as c:
            sid = (await c.post("/sessions")).json()["session_id"]
            scripts.add(sid, sampled_text("glm", content="hello"))
            url = f"/sessions/{sid}/v1/chat/completions"
            msgs = [{"role": "user", "content": "hi"}]
            a = (await c.post(url, json={"messages": msgs})).json()["choices"][0]["message"]
            r = await c.post(url, json={"messages": msgs + [a, {"role": "system", "content": "new rules"}]})
            assert r.status_code == 400 and "cannot append a 'system'" in r.json()["error"]["message"]

    asyncio.run(run())


def test_scripted_engine_is_a_rollout_engine(codecs):
    from miles_engine.engines.protocol import RolloutEngine

    assert isinstance(ScriptedEngine(codecs["chatml"].tokenizer), RolloutEngine)

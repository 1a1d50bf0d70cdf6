"""Session semantics over the HTTP API (ASGI): linear retry/divergence, branching ownership,
matchers, reasoning toggles, stop strings, truncation, server-side collection."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from .helpers import BASH, asgi, assert_exact, make_server, sampled_text


async def _open(client, **body: Any) -> tuple[str, str]:
    r = await client.post("/sessions", json=body or None)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["base_url"].endswith(f"/sessions/{data['session_id']}/v1")
    assert len(data["session_id"]) >= 22  # >= 128 random bits (token_urlsafe(24) -> 32 chars)
    return data["session_id"], f"/sessions/{data['session_id']}/v1/chat/completions"


async def _chat(client, url: str, messages: list, **extra: Any) -> dict:
    r = await client.post(url, json={"messages": messages, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def test_linear_retry_replaces_the_last_generation(codecs):
    codec = codecs["qwen3"]
    manager, engine, scripts = make_server(codec)

    async def run():
        async with asgi(manager) as c:
            sid, url = await _open(c)
            scripts.add(sid, sampled_text("qwen3", content="one", reasoning="r1"),
                        sampled_text("qwen3", content="two", reasoning="r2"),
                        sampled_text("qwen3", content="two again", reasoning="r3"))
            msgs = [{"role": "user", "content": "hi"}]
            a1 = await _chat(c, url, msgs)
            msgs += [a1, {"role": "user", "content": "more"}]
            await _chat(c, url, msgs)
            retry = await _chat(c, url, msgs)  # same history again: retry of the last turn
            assert retry["content"] == "two again"
            report = (await c.get(f"/sessions/{sid}/trajectories")).json()
            assert len(report["trajectories"]) == 1 and len(report["trajectories"][0]["turns"]) == 2
            assert_exact(report, engine, sid)
            assert report["trajectories"][0]["token_ids"][-len(engine.results[-1].output_ids):] == \
                engine.results[-1].output_ids

    asyncio.run(run())


def test_linear_deep_divergence_is_409_and_changes_nothing(codecs):
    codec = codecs["chatml"]
    manager, engine, scripts = make_server(codec)

    async def run():
        async with asgi(manager) as c:
            sid, url = await _open(c)
            scripts.add(sid, *(sampled_text("chatml", content=f"a{i}") for i in range(3)))
            msgs = [{"role": "user", "content": "q0"}]
            for i in range(3):
                msgs.append(await _chat(c, url, msgs))
                msgs.append({"role": "user", "content": f"q{i + 1}"})
            before = (await c.get(f"/sessions/{sid}/trajectories")).json()
            bad = msgs[:2] + [{"role": "user", "content": "edited history"}]
            r = await c.post(url, json={"messages": bad})
            assert r.status_code == 409
            err = r.json()["error"]
            assert err["code"] == "history_diverged" and "messages[2]" in err["message"]
            r = await c.post(url, json={"messages": msgs, "tools": [BASH]})  # tools changed
            assert r.status_code == 409 and "tools differ" in r.json()["error"]["message"]
            after = (await c.get(f"/sessions/{sid}/trajectories")).json()
            assert after == before

    asyncio.run(run())


def test_branching_tree_owns_each_generation_once(codecs):
    codec = codecs["glm"]
    manager, engine, scripts = make_server(codec)

    async def run():
        async with asgi(manager) as c:
            sid, url = await _open(c, mode="branching")
            scripts.add(sid, sampled_text("glm", content="root answer", reasoning="r"),
                        sampled_text("glm", content="branch A", reasoning="a"),
                        sampled_text("glm", content="branch B", reasoning="b"),
                        sampled_text("glm", content="A deeper", reasoning="c"))
            base = [{"role": "user", "content": "start"}]
            a0 = await _chat(c, url, base)
            a_hist = base + [a0, {"role": "user", "content": "go A"}]
            b_hist = base + [a0, {"role": "user", "content": "go B"}]
            a1 = await _chat(c, url, a_hist)
            await _chat(c, url, b_hist)
            await _chat(c, url, a_hist + [a1, {"role": "user", "content": "deeper"}])
            report = (await c.get(f"/sessions/{sid}/trajectories")).json()
            trajs = report["trajectories"]
            assert len(trajs) == 2  # leaves: A-deeper and B
            assert_exact(report, engine, sid)
            root_span = trajs[0]["turns"][0]
            owners = [t["turns"][0]["owned"] for t in trajs]
            assert owners.count(True) == 1  # the shared first generation is trained once
            s, e = root_span["completion_start"], root_span["completion_end"]
            assert sum(sum(t["loss_mask"][s:e]) for t in trajs) == e - s
            assert trajs[0]["token_ids"][:e] == trajs[1]["token_ids"][:e]

    asyncio.run(run())


@pytest.mark.parametrize("drop", [True, False])
def test_branching_retries_are_dropped_unless_asked(codecs, drop):
    codec = codecs["chatml"]
    manager, engine, scripts = make_server(codec)

    async def run():
        async with asgi(manager) as c:
            sid, url = await _open(c, mode="branching", drop_retries=drop)
            scripts.add(sid, sampled_text("chatml", content="first try"), sampled_text("chatml", content="second"))
            msgs = [{"role": "user", "content": "q"}]
            await _chat(c, url, msgs)
            await _chat(c, url, msgs)
            report = (await c.get(f"/sessions/{sid}/trajectories")).json()
            assert len(report["trajectories"]) == (1 if drop else 2)
            assert_exact(report, engine, sid)

    asyncio.run(run())


def test_matchers(codecs):
    codec = codecs["qwen3"]
    manager, engine, scripts = make_server(codec)
    call = '{"command": "ls", "flags": "-l"}'
    out = sampled_text("qwen3", reasoning="r", command="ls").replace(
        '"arguments": {"command": "ls"}', f'"arguments": {call}')

    async def run():
        async with asgi(manager) as c:
            results = {}
            for matcher in ("strict", "loose_tool_call"):
                sid, url = await _open(c, matcher=matcher)
                scripts.add(sid, out, sampled_text("qwen3", content="done", reasoning="r"))
                msgs = [{"role": "user", "content": "list"}]
                a = await _chat(c, url, msgs, tools=[BASH])
                fn = a["tool_calls"][0]["function"]
                fn["arguments"] = json.dumps(json.loads(fn["arguments"]), indent=1, sort_keys=True)  # re-serialised
                msgs += [a, {"role": "tool", "tool_call_id": a["tool_calls"][0]["id"], "content": "x"}]
                r = await c.post(url, json={"messages": msgs, "tools": [BASH]})
                results[matcher] = r.status_code
            assert results == {"strict": 409, "loose_tool_call": 200}
            r = await c.post("/sessions", json={"matcher": "no_such_matcher"})
            assert r.status_code == 400

    asyncio.run(run())


def bad_matcher(stored, replayed):
    return "yes"


def test_dotted_path_matcher_that_returns_non_bool_is_a_500(codecs, monkeypatch):
    import sys
    import types

    mod = types.ModuleType("tito_test_matchers")
    mod.bad = bad_matcher
    mod.role_only = lambda a, b: a["role"] == b["role"]
    monkeypatch.setitem(sys.modules, "tito_test_matchers", mod)
    codec = codecs["chatml"]
    manager, engine, scripts = make_server(codec)

    async def run():
        async with asgi(manager) as c:
            sid, url = await _open(c, matcher="tito_test_matchers:bad")
            scripts.add(sid, sampled_text("chatml", content="a"))
            msgs = [{"role": "user", "content": "q"}]
            msgs += [await _chat(c, url, msgs), {"role": "user", "content": "q2"}]
            r = await c.post(url, json={"messages": msgs})
            assert r.status_code == 500 and r.json()["error"]["type"] == "matcher_error"
            sid, url = await _open(c, matcher="tito_test_matchers:role_only")
            scripts.add(sid, sampled_text("chatml", content="a"), sampled_text("chatml", content="b"))
            msgs = [{"role": "user", "content": "q"}]
            a = await _chat(c, url, msgs)
            a["content"] = "rewritten by the harness"  # replayed text only locates the checkpoint
            await _chat(c, url, msgs + [a, {"role": "user", "content": "q2"}])
            report = (await c.get(f"/sessions/{sid}/trajectories")).json()
            assert_exact(report, engine, sid)

    asyncio.run(run())


def test_reasoning_toggle_stop_strings_truncation_and_collection(codecs):
    codec = codecs["qwen3"]
    manager, engine, scripts = make_server(codec, record_routed_experts=True, routed_shape=(2, 2))

    async def run():
        async with asgi(manager) as c:
            sid, url = await _open(c)
            scripts.add(sid, sampled_text("qwen3", content="plain answer", thinking=False),
                        sampled_text("qwen3", content="alpha STOP beta", reasoning="x"),
                        "a very long answer that never stops")
            msgs = [{"role": "user", "content": "q"}]
            a = await _chat(c, url, msgs, chat_template_kwargs={"enable_thinking": False})
            assert a["content"] == "plain answer" and a["reasoning_content"] == ""
            a.pop("reasoning_content")  # clients often drop it; strict matching still finds the turn
            msgs += [a, {"role": "user", "content": "q2"}]
            r = await c.post(url, json={"messages": msgs, "stop": ["STOP"], "logprobs": True})
            body = r.json()["choices"][0]
            assert body["message"]["content"] == "alpha " and body["finish_reason"] == "stop"
            assert body["logprobs"]["content"] and all(x["logprob"] < 0 for x in body["logprobs"]["content"])
            msgs += [body["message"], {"role": "user", "content": "q3"}]
            r = await c.post(url, json={"messages": msgs, "max_tokens": 3})
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert r.json()["choices"][0]["logprobs"] is None
            report = (await c.get(f"/sessions/{sid}/trajectories")).json()
            traj = report["trajectories"][0]
            assert [t["finish_reason"] for t in traj["turns"]] == ["stop", "stop", "length"]
            assert_exact(report, engine, sid)
            sampled = [i for i, m in enumerate(traj["loss_mask"]) if m]
            assert all(traj["routed_experts"][i] is not None for i in sampled)
            assert all(traj["routed_experts"][i] is None for i in range(len(traj["token_ids"])) if i not in sampled)
            assert all(traj["weight_versions"][i] == 0 for i in sampled)

    asyncio.run(run())


def test_delete_with_trajectories_collects_and_closes_in_one_request(codecs):
    codec = codecs["qwen3"]
    manager, engine, scripts = make_server(codec)

    async def run():
        async with asgi(manager) as c:
            sid, url = await _open(c)
            scripts.add(sid, sampled_text("qwen3", content="one", reasoning="r1"))
            await _chat(c, url, [{"role": "user", "content": "hi"}])
            expected = (await c.get(f"/sessions/{sid}/trajectories")).json()
            r = await c.delete(f"/sessions/{sid}", params={"trajectories": "true"})
            assert r.status_code == 200, r.text
            report = r.json()
            assert report["deleted"] is True and report["session_id"] == sid
            assert report["trajectories"] == expected["trajectories"]
            assert_exact(report, engine, sid)
            assert (await c.get(f"/sessions/{sid}/trajectories")).status_code == 404
            plain = await _open(c)
            r = await c.delete(f"/sessions/{plain[0]}")
            assert r.json() == {"session_id": plain[0], "deleted": True}

    asyncio.run(run())


def test_mismatch_diagnostic_runs_on_every_nth_session_unless_a_session_asks(codecs):
    codec = codecs["chatml"]
    manager, engine, scripts = make_server(codec, diagnose_every=3)

    async def episode(c, **body: Any) -> dict:
        sid, url = await _open(c, **body)
        scripts.add(sid, sampled_text("chatml", content="ok"))
        await _chat(c, url, [{"role": "user", "content": "hi"}])
        r = await c.delete(f"/sessions/{sid}", params={"trajectories": "true"})
        assert r.status_code == 200, r.text
        return r.json()

    async def run():
        async with asgi(manager) as c:
            reports = [await episode(c) for _ in range(6)]
            diagnosed = ["tito_session_mismatch" in r["trajectories"][0] for r in reports]
            assert diagnosed == [True, False, False, True, False, False]
            assert [r["metrics"]["tito_session_mismatch_trajectories"] for r in reports] == [1, 0, 0, 1, 0, 0]
            assert "tito_session_mismatch_rate" not in reports[1]["metrics"]
            assert "tito_session_mismatch" in (await episode(c, diagnose=True))["trajectories"][0]  # 7th: asked
            assert "tito_session_mismatch" not in (await episode(c, diagnose=False))["trajectories"][0]  # 8th
            r = await c.post("/sessions", json={"diagnose": "yes"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "diagnose", r.text
            metrics = (await c.get("/metrics")).json()
            assert metrics["tito_session_mismatch_trajectories"] == 3 and metrics["sessions_created"] == 8

    asyncio.run(run())
    never, _, _ = make_server(codec, diagnose_every=0)
    assert not never.create().diagnose and not never.create().diagnose


def test_fastapi_native_telemetry_is_off_unless_asked(codecs, monkeypatch):
    fastapi = pytest.importorskip("fastapi")
    import inspect

    if "telemetry" not in inspect.signature(fastapi.FastAPI.__init__).parameters:
        pytest.skip("this FastAPI has no native telemetry")
    from opentelemetry import trace

    lookups: list[int] = []
    real = trace.get_tracer_provider
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: lookups.append(1) or real())

    async def run(otel: bool) -> int:
        lookups.clear()
        manager, _, _ = make_server(codecs["chatml"], otel=otel)
        async with asgi(manager) as c:
            for _ in range(3):
                assert (await c.get("/health")).status_code == 200
        return len(lookups)

    assert asyncio.run(run(otel=False)) == 0
    assert asyncio.run(run(otel=True)) >= 3  # FastAPI asks on every request

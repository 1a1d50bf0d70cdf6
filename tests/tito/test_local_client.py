"""``client: local``: an agent in the session server's own process calls its ASGI app directly —
same results, statuses and bodies as over HTTP, no socket; anything else goes over HTTP."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from miles_engine.rollout.episode import run_episode
from miles_engine.tito import client as tito_client
from miles_engine.tito import local
from miles_engine.tito.agent import TitoAgent, TitoAgentOptions
from miles_engine.tito.client import SessionClient, close_pools
from miles_engine.tito.serve import start_session_server
from miles_engine.engines.scripted import ScriptedEngine

from ..core.fakes import FileTask, MemoryBackend
from .helpers import Scripts, assert_exact, sampled_text
from .test_agents import LIMITS


def _aiohttp_pool_used(url: str) -> bool:
    return ("aiohttp", url) in tito_client._POOLS.get(asyncio.get_running_loop(), {})


def _script(scripts: Scripts) -> None:
    scripts.default.extend([sampled_text("qwen3", reasoning="write it", command="write /app/answer yes"),
                            sampled_text("qwen3", content="Done.", reasoning="ok")])


def test_local_and_http_clients_give_the_same_episode(codecs):
    pytest.importorskip("aiohttp")
    codec = codecs["qwen3"]

    async def main():
        results = {}
        for kind in ("local", "aiohttp"):
            scripts = Scripts()
            _script(scripts)
            engine = ScriptedEngine(codec.tokenizer, scripts)
            server = await start_session_server(engine, codec)
            try:
                agent = TitoAgent(TitoAgentOptions(server_url=server.url, client=kind))
                result = await run_episode(FileTask(limits=LIMITS), agent, MemoryBackend())
                assert _aiohttp_pool_used(server.url) == (kind == "aiohttp")  # local: no socket at all
                assert_exact({"trajectories": result.agent.info["trajectories"]}, engine,
                             engine.requests[0].session_id)
                results[kind] = result
            finally:
                await close_pools()
                await server.stop()
            assert local.app_for(server.url) is None  # a stopped server is no longer reachable in-process
        a, b = results["local"], results["aiohttp"]
        assert a.reward.reward == b.reward.reward == 1.0 and a.agent.turns == b.agent.turns == 2
        rows = [[t["token_ids"] for t in r.agent.info["trajectories"]] for r in (a, b)]
        assert rows[0] == rows[1] and a.transcript == b.transcript

    asyncio.run(main())


def test_errors_are_the_same_statuses_and_bodies_as_over_http(codecs):
    pytest.importorskip("aiohttp")
    codec = codecs["qwen3"]

    async def main():
        server = await start_session_server(ScriptedEngine(codec.tokenizer, Scripts()), codec)
        try:
            answers = {}
            for kind in ("local", "aiohttp"):
                c = SessionClient(server.url, transport=kind, use_openai=False)
                answers[kind] = [
                    await c._request("GET", f"{server.url}/sessions/nope/trajectories"),
                    await c._request("POST", f"{server.url}/sessions", {"mode": "sideways"}),
                    await c._request("DELETE", f"{server.url}/sessions/nope?trajectories=true"),
                    await c._request("DELETE", f"{server.url}/sessions/nope?trajectories=maybe"),
                    await c._request("POST", f"{server.url}/sessions/nope/v1/chat/completions", {"messages": []}),
                    await c._request("PUT", f"{server.url}/sessions"),
                ]
            assert [s for s, _ in answers["local"]] == [404, 400, 404, 400, 404, 405]
            assert b'"param":"trajectories"' in answers["local"][3][1]
            assert answers["local"] == answers["aiohttp"]
        finally:
            await close_pools()
            await server.stop()

    asyncio.run(main())


def test_a_server_of_another_event_loop_is_reached_over_http(codecs):
    """Only the loop that serves the app may call it in-process; other loops use the socket."""
    pytest.importorskip("aiohttp")
    codec = codecs["qwen3"]
    started, stop = threading.Event(), threading.Event()
    holder = {}

    def serve():
        async def main():
            holder["server"] = await start_session_server(ScriptedEngine(codec.tokenizer, holder["scripts"]), codec)
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.02)
            await holder["server"].stop()
        asyncio.run(main())

    holder["scripts"] = Scripts()
    _script(holder["scripts"])
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(30)
    url = holder["server"].url

    async def main():
        assert local.app_for(url) is None
        agent = TitoAgent(TitoAgentOptions(server_url=url, client="local"))
        result = await run_episode(FileTask(limits=LIMITS), agent, MemoryBackend())
        assert result.reward.reward == 1.0 and _aiohttp_pool_used(url)
        await close_pools()

    try:
        asyncio.run(main())
    finally:
        stop.set()
        thread.join(30)


def test_an_app_that_fails_before_answering_is_an_error_not_a_hang():
    async def broken(scope, receive, send):
        await receive()
        raise RuntimeError("boom")

    async def half(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        raise RuntimeError("cut")

    async def main():
        for app, match in ((broken, "RuntimeError: boom"), (half, "RuntimeError: cut")):
            with pytest.raises(local.LocalResponseError, match=match):
                await asyncio.wait_for(local.request(app, "POST", "http://x:1/a?b=1", b"{}", {}), 5)

    asyncio.run(main())


def test_hot_routes_skip_the_middleware_stack_with_the_same_answers(codecs, monkeypatch):
    """Open, chat and collect-and-close go straight to their endpoints in-process; everything
    else (and every route once the app has user middleware) runs through the whole app."""
    pytest.importorskip("aiohttp")
    codec = codecs["qwen3"]

    async def main():
        scripts = Scripts()
        scripts.default.extend([sampled_text("qwen3", content="hi")] * 4)
        server = await start_session_server(ScriptedEngine(codec.tokenizer, scripts), codec)
        app = local.app_for(server.url)
        try:
            c = SessionClient(server.url, transport="local", use_openai=False)
            assert (await c._request("GET", f"{server.url}/health"))[0] == 200  # builds the stack
            through_stack: list[str] = []
            stack = app.middleware_stack

            async def counting(scope, receive, send):
                through_stack.append(f"{scope['method']} {scope['path']}")
                await stack(scope, receive, send)

            app.middleware_stack = counting
            status, raw = await c._request("POST", f"{server.url}/sessions", {})
            sid = json.loads(raw)["session_id"]
            chat = f"{server.url}/sessions/{sid}/v1/chat/completions"
            assert (await c._request("POST", chat, {"messages": [{"role": "user", "content": "x"}]}))[0] == 200
            assert (await c._request("DELETE", f"{server.url}/sessions/{sid}?trajectories=true"))[0] == 200
            assert through_stack == []
            assert (await c._request("GET", f"{server.url}/sessions/{sid}"))[0] == 404
            assert (await c._request("PUT", f"{server.url}/sessions"))[0] == 405
            assert through_stack == [f"GET /sessions/{sid}", "PUT /sessions"]

            # an unexpected failure is the same 500 either way
            def broken(body=None):
                raise RuntimeError("disk on fire")

            monkeypatch.setattr(app.state.manager, "create", broken)
            answers = {kind: await SessionClient(server.url, transport=kind, use_openai=False)._request(
                "POST", f"{server.url}/sessions", {}) for kind in ("local", "aiohttp")}
            assert answers["local"][0] == 500 and b"disk on fire" in answers["local"][1]
            assert answers["local"] == answers["aiohttp"]
            monkeypatch.undo()

            app.user_middleware.append(object())  # a user middleware must not be skipped
            through_stack.clear()
            await c._request("POST", f"{server.url}/sessions", {})
            assert through_stack == ["POST /sessions"]
            app.user_middleware.pop()
        finally:
            await close_pools()
            await server.stop()

    asyncio.run(main())

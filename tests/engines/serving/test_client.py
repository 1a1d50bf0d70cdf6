"""HttpEngine: retries only for idempotent calls; parsing of real-SGLang shapes (recent spans,
older one-version-per-request, ``"default"``), error mapping; abort on client disconnect."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from miles_engine.engines.errors import EngineServerError, EngineUnavailable
from miles_engine.engines.http import wire
from miles_engine.engines.http.client import HttpEngine
from miles_engine.engines.protocol import GenerateRequest, SamplingParams


def scripted(handler: Any) -> tuple[HttpEngine, list[str]]:
    seen: list[str] = []

    def wrapped(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return handler(request, len([p for p in seen if p == request.url.path]))
    return HttpEngine("http://sglang", transport=httpx.MockTransport(wrapped), backoff_s=0.001), seen


def test_only_idempotent_calls_are_retried() -> None:
    def handler(request: httpx.Request, n: int) -> httpx.Response:
        if n <= 2:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"status": "ok"})

    async def main() -> None:
        client, seen = scripted(handler)
        await client.pause("in_place")  # third attempt succeeds
        assert seen.count("/pause_generation") == 3
        with pytest.raises(EngineUnavailable, match="did not answer POST /generate"):
            await client.generate(GenerateRequest([1]))
        assert seen.count("/generate") == 1  # never re-dispatched by the client
        assert not await client.health()
        await client.aclose()
        with pytest.raises(EngineUnavailable, match="closed"):
            await client.resume()
    asyncio.run(main())


def test_recent_sglang_spans_and_older_single_version() -> None:
    def handler(request: httpx.Request, n: int) -> httpx.Response:
        body = json.loads(request.content)
        assert request.headers[wire.SESSION_HEADER] == "sess" and body["routing_key"] == "sess"
        assert body["sampling_params"] == {"temperature": 0.5, "top_p": 1.0, "top_k": 5, "max_new_tokens": 5,
                                           "stop_token_ids": [9], "sampling_seed": 11}
        meta: dict[str, Any] = {"id": body["rid"], "prompt_tokens": 2, "completion_tokens": 5, "cached_tokens": 2,
                                "finish_reason": {"type": "stop", "matched": 9},
                                "output_token_logprobs": [[-1.0, t, None] for t in (4, 5, 6, 7, 9)]}
        if n == 1:  # recent SGLang: spans (versions are strings)
            meta.update(weight_version="4", weight_versions=[{"version": "3", "start": 0, "end": 2},
                                                             {"version": "4", "start": 2, "end": 5}])
        else:  # older SGLang, never updated
            meta.update(weight_version="default")
        return httpx.Response(200, json={"text": "abcde", "meta_info": meta})

    async def main() -> None:
        client, _ = scripted(handler)
        req = GenerateRequest([1, 2], SamplingParams(temperature=0.5, top_k=5, max_new_tokens=5, stop_token_ids=(9,),
                                                     seed=11), session_id="sess")
        res = await client.generate(req)
        assert res.output_ids == [4, 5, 6, 7, 9] and res.finish_reason == "stop" and res.cached_tokens == 2
        assert res.weight_versions == [3, 3, 4, 4, 4] and res.info["weight_versions_exact"]
        assert client.weight_version == 4
        res = await client.generate(req)
        assert res.weight_versions == [0] * 5 and not res.info["weight_versions_exact"]
    asyncio.run(main())


@pytest.mark.parametrize("status,body,exc,fragment", [
    (400, {"object": "error", "message": "bad top_k", "type": "Bad Request", "code": 400}, ValueError, "bad top_k"),
    (400, {"error": {"message": "token id out of range"}}, ValueError, "out of range"),
    (503, {}, EngineUnavailable, "generate"),
    (500, {"error": {"message": "boom", "type": "InternalServerError"}}, EngineServerError, "boom"),
])
def test_error_mapping(status: int, body: dict[str, Any], exc: type[Exception], fragment: str) -> None:
    async def main() -> None:
        client, _ = scripted(lambda r, n: httpx.Response(status, json=body))
        with pytest.raises(exc, match=fragment):
            await client.generate(GenerateRequest([1]))
    asyncio.run(main())


def test_abort_on_empty_sglang_body_and_finish_abort() -> None:
    def handler(request: httpx.Request, n: int) -> httpx.Response:
        if request.url.path == "/abort_request":
            return httpx.Response(200)
        meta = {"id": "x", "finish_reason": {"type": "abort", "message": "Abort before prefill"},
                "prompt_tokens": 1, "completion_tokens": 0, "weight_version": "2", "output_token_logprobs": []}
        return httpx.Response(200, json={"text": "", "output_ids": [], "meta_info": meta})

    async def main() -> None:
        client, _ = scripted(handler)
        assert await client.abort("x") is True
        res = await client.generate(GenerateRequest([1]))
        assert res.finish_reason == "abort" and res.info["abort_message"] == "Abort before prefill"
    asyncio.run(main())


def test_server_aborts_a_request_whose_client_went_away() -> None:
    import uvicorn

    from miles_engine.run.engine_server import create_engine_app
    from miles_engine.run.engine_server import bind_socket
    from tests.engines.fakes import FakeEngine

    async def main() -> None:
        engine = FakeEngine(step_delay=0.01)
        sock = bind_socket("127.0.0.1", 0)
        server = uvicorn.Server(uvicorn.Config(create_engine_app(engine), log_level="warning"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        client = HttpEngine(f"http://127.0.0.1:{sock.getsockname()[1]}", generate_timeout=0.3, retries=20,
                            backoff_s=0.05)
        try:
            await client.connect()
            with pytest.raises(EngineUnavailable, match="ReadTimeout"):
                await client.generate(GenerateRequest([1], SamplingParams(max_new_tokens=1000)))
            for _ in range(40):
                if not engine.inflight:
                    break
                await asyncio.sleep(0.05)
            assert not engine.inflight  # aborted server-side, not left decoding
        finally:
            await client.aclose()
            server.should_exit = True
            await serving
    asyncio.run(main())

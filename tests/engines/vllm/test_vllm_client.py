"""The vLLM client's retract logic against a scripted server (httpx.MockTransport): which aborted
requests are sent again, whatever the order in which vLLM's answers and our resume arrive."""

from __future__ import annotations

import asyncio
import json

import httpx

from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.engines.vllm.client import VllmEngine


class ScriptedVllm:
    """Answers the first completion only once ``release`` is set, as vLLM answers a request its pause
    aborted: with the tokens so far and ``finish_reason: abort``; later completions run to the end."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.bodies: list[dict] = []
        self.aborted: list[list[str]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/completions":
            body = json.loads(request.content)
            self.bodies.append(body)
            if len(self.bodies) == 1:
                await self.release.wait()
                return _completion([7, 8], "abort")
            return _completion(list(range(body["max_tokens"])), "length")
        if path == "/abort_requests":
            self.aborted.append(json.loads(request.content)["request_ids"])
            self.release.set()
            return httpx.Response(200, json={})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": "0"})
        return httpx.Response(200, json={})  # /pause, /resume


def _completion(ids: list[int], finish: str) -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"token_ids": ids, "finish_reason": finish,
                                                  "logprobs": {"token_logprobs": [-0.5] * len(ids)}}],
                                     "usage": {}})


def _engine(server: ScriptedVllm) -> VllmEngine:
    engine = VllmEngine("http://vllm.test", transport=httpx.MockTransport(server), retries=0)
    engine.model_id = "policy"
    return engine


def _request(request_id: str = "r") -> GenerateRequest:
    return GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=6), request_id=request_id)


async def _until_sent(server: ScriptedVllm, n: int) -> None:
    for _ in range(1000):
        if len(server.bodies) >= n:
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the request never reached the server")


def test_a_retract_already_resumed_when_vllm_answers_still_sends_the_request_again():
    async def main() -> None:
        server = ScriptedVllm()
        engine = _engine(server)
        pending = asyncio.ensure_future(engine.generate(_request()))
        await _until_sent(server, 1)
        await engine.pause("retract")
        engine._version = 1  # what /update_weight_version records during a push
        await engine.resume()
        server.release.set()  # vLLM's answer to the aborted request arrives after the resume
        result = await asyncio.wait_for(pending, 10)
        assert result.finish_reason == "length" and result.info["segments"] == 2
        assert result.output_ids == [7, 8, 0, 1, 2, 3]
        assert result.weight_versions == [0, 0, 1, 1, 1, 1]
        # sent again with the tokens so far appended to the prompt, for what was left
        assert server.bodies[1]["prompt"] == [1, 2, 3, 7, 8] and server.bodies[1]["max_tokens"] == 4
        await engine.aclose()

    asyncio.run(main())


def test_an_abort_pause_or_a_callers_abort_is_never_sent_again():
    async def main() -> None:
        for how in ("abort-pause", "caller"):
            server = ScriptedVllm()
            engine = _engine(server)
            pending = asyncio.ensure_future(engine.generate(_request("doomed")))
            await _until_sent(server, 1)
            if how == "caller":
                assert await engine.abort("doomed")
                assert server.aborted == [["cmpl-doomed-0-0"]]
            else:
                await engine.pause("abort")
                await engine.resume()
                server.release.set()
            result = await asyncio.wait_for(pending, 10)
            assert (result.finish_reason, result.output_ids, result.info["segments"]) == ("abort", [7, 8], 1), how
            await engine.aclose()

    asyncio.run(main())

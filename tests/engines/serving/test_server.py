"""The SGLang-compatible server over a fake engine (httpx ASGITransport; one real uvicorn)."""

from __future__ import annotations

import asyncio
import base64
import pickle
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from miles_engine.engines.http import tensors, wire
from miles_engine.engines.http.client import HttpEngine
from miles_engine.run.engine_server import create_engine_app
from miles_engine.run.engine_server import bind_socket
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from tests.engines.fakes import FakeEngine


def run_with(engine: FakeEngine, fn: Callable[[httpx.AsyncClient], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        app = create_engine_app(engine)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://srv") as c:
            return await fn(c)
    return asyncio.run(main())


GOOD = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}}


def test_generate_has_sglang_shape() -> None:
    async def go(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={**GOOD, "rid": "r1", "return_logprob": True,
                                            "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9,
                                                                "top_k": 1 << 30, "sampling_seed": 3,
                                                                "skip_special_tokens": False}})
        assert r.status_code == 200, r.text
        out = r.json()
        assert set(out) == {"text", "output_ids", "meta_info"}
        meta = out["meta_info"]
        assert meta["id"] == "r1"
        assert meta["finish_reason"] == {"type": "length", "length": 4}
        assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 4, 0)
        assert meta["weight_version"] == "0"
        assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 4}]
        assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
        assert all(len(e) == 3 and e[2] is None and e[0] < 0 for e in meta["output_token_logprobs"])
        # return_logprob defaults to False, as in SGLang
        r = await c.post("/generate", json=GOOD)
        assert "output_token_logprobs" not in r.json()["meta_info"]
    run_with(FakeEngine(), go)


def test_stop_token_and_session_keys() -> None:
    engine = FakeEngine()

    async def go(c: httpx.AsyncClient) -> None:
        first = (await c.post("/generate", json=GOOD)).json()["output_ids"][0]
        r = await c.post("/generate", json={**GOOD, "sampling_params": {"max_new_tokens": 9, "stop_token_ids": [first]}})
        assert r.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
        await c.post("/generate", json=GOOD, headers={wire.SESSION_HEADER: "hdr"})
        assert engine.calls[-1].session_id == "hdr"
        await c.post("/generate", json={**GOOD, "routing_key": "rk"})
        assert engine.calls[-1].session_id == "rk"
        await c.post("/generate", json={**GOOD, "session_id": "sid"}, headers={wire.SESSION_HEADER: "hdr"})
        assert engine.calls[-1].session_id == "sid"
    run_with(engine, go)


BAD_GENERATE = [
    ({"input_ids": [1, 2, 999]}, "out of vocabulary"),
    ({"input_ids": []}, "empty"),
    ({"sampling_params": {}}, "input_ids is required"),
    ({"text": "hello"}, "token ids"),
    ({"input_ids": list(range(1, 60)) * 5}, "context"),
    ({**GOOD, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0},
     "cannot score prompts"),  # prefill-only scoring needs an engine with score_prompt
    ({**GOOD, "sampling_params": {"max_new_tokens": 0}, "logprob_start_len": 3}, "logprob_start_len=3 is higher"),
    ({**GOOD, "top_logprobs_num": 2}, "only supported on a prefill-only scoring request"),
    ({**GOOD, "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    ({**GOOD, "sampling_params": {"temprature": 0.5}}, "did you mean 'temperature'"),
    ({**GOOD, "sampling_params": {"n": 2}}, "not supported"),
    ({**GOOD, "sampling_params": {"top_p": 0}}, "top_p"),
    ({**GOOD, "sampling_params": {"top_k": 0}}, "top_k"),
    ({**GOOD, "sampling_params": {"temperature": -1}}, "temperature"),
    ({**GOOD, "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({**GOOD, "sampling_params": [1]}, "JSON object"),
    ({**GOOD, "return_routed_experts": True}, "dense"),
    ({**GOOD, "input_ids": [[1, 2], [3]]}, "batched"),
    ({**GOOD, "input_ids": [1, "2"]}, "integers"),
    ({**GOOD, "input_ids": [1, True]}, "integers"),
    ({**GOOD, "stream": True}, "stream"),
    ({**GOOD, "frobnicate": 1}, "unknown request field"),
    ({**GOOD, "rid": ["a", "b"]}, "rid"),
]


@pytest.mark.parametrize("body,fragment", BAD_GENERATE, ids=[f[1] for f in BAD_GENERATE])
def test_bad_generate_is_400_and_engine_keeps_serving(body: dict[str, Any], fragment: str) -> None:
    async def go(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert fragment in err["message"] and err["type"] == "BadRequestError"
        assert (await c.post("/generate", json=GOOD)).status_code == 200
    run_with(FakeEngine(), go)


def test_malformed_bodies_and_engine_faults() -> None:
    engine = FakeEngine()

    async def go(c: httpx.AsyncClient) -> None:
        for content in (b"{not json", b"[1, 2]", b""):
            r = await c.post("/generate", content=content, headers={"content-type": "application/json"})
            assert r.status_code == 400 and "error" in r.json()
        original = engine.generate

        async def boom(req: GenerateRequest) -> Any:
            raise RuntimeError("kernel exploded")
        engine.generate = boom  # type: ignore[method-assign]
        r = await c.post("/generate", json=GOOD)
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
        engine.generate = original  # type: ignore[method-assign]
        assert (await c.post("/generate", json=GOOD)).status_code == 200
    run_with(engine, go)


def test_weight_updates_and_refusals(tmp_path: Path) -> None:
    engine = FakeEngine()

    async def go(c: httpx.AsyncClient) -> None:
        good = {"head.bias": torch.full((64,), 2.0)}
        ok = await c.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": tensors.encode_named_tensors(good), "load_format": tensors.TENSOR_LOAD_FORMAT,
            "weight_version": "5"})
        assert ok.status_code == 200 and ok.json()["success"] is True
        assert engine.weight_version == 5 and torch.equal(engine.weights()["head.bias"], good["head.bias"])
        refusals = [
            ("/update_weights_from_tensor", {"serialized_named_tensors": tensors.encode_named_tensors(
                {"head.bias": torch.zeros(3)}), "load_format": tensors.TENSOR_LOAD_FORMAT}, "model has"),
            ("/update_weights_from_tensor", {"serialized_named_tensors": tensors.encode_named_tensors(
                {"nope": torch.zeros(3)}), "load_format": tensors.TENSOR_LOAD_FORMAT}, "unknown tensor"),
            ("/update_weights_from_tensor", {"serialized_named_tensors": tensors.encode_named_tensors(
                {"head.bias": torch.zeros(64, dtype=torch.float16)}), "load_format": tensors.TENSOR_LOAD_FORMAT}, "float16"),
            ("/update_weights_from_tensor", {"serialized_named_tensors": [base64.b64encode(pickle.dumps(good)).decode()],
                                             "load_format": tensors.TENSOR_LOAD_FORMAT}, "pickled"),
            ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}, "load_format"),
            ("/update_weights_from_disk", {"model_path": str(tmp_path / "missing")}, "does not exist"),
            ("/update_weights_from_disk", {}, "model_path"),
            ("/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "v7"}, "not an integer"),
        ]
        for path, body, fragment in refusals:
            r = await c.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            assert fragment in r.json()["error"]["message"], r.text
        assert engine.weight_version == 5 and torch.equal(engine.weights()["head.bias"], good["head.bias"])
        save_file({"head.bias": torch.full((64,), 3.0)}, str(tmp_path / "model.safetensors"))
        r = await c.post("/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": "6"})
        assert r.status_code == 200 and r.json()["success"] and engine.weight_version == 6
        assert (await c.get("/get_weight_version")).json() == {"weight_version": "6"}
        assert (await c.post("/generate", json=GOOD)).json()["meta_info"]["weight_version"] == "6"
    run_with(engine, go)


def test_pause_continue_abort_and_info() -> None:
    engine = FakeEngine(step_delay=0.01)

    async def go(c: httpx.AsyncClient) -> None:
        assert (await c.post("/pause_generation", json={"mode": "sideways"})).status_code == 400
        assert (await c.post("/pause_generation", json={"mode": "retract"})).json()["status"] == "ok"
        task = asyncio.create_task(c.post("/generate", json=GOOD))
        await asyncio.sleep(0.2)
        assert not task.done()
        assert (await c.post("/continue_generation")).json()["status"] == "ok"
        assert (await task).json()["meta_info"]["finish_reason"]["type"] == "length"
        long = {"input_ids": [1], "sampling_params": {"max_new_tokens": 200}}
        task = asyncio.create_task(c.post("/generate", json={**long, "rid": "slow"}))
        await asyncio.sleep(0.1)
        assert (await c.post("/abort_request", json={"rid": "slow"})).json()["success"] is True
        meta = (await task).json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 200
        tasks = [asyncio.create_task(c.post("/generate", json=long)) for _ in range(3)]
        await asyncio.sleep(0.1)
        assert len((await c.post("/abort_request", json={"abort_all": True})).json()["aborted"]) == 3
        for t in tasks:
            assert (await t).json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert (await c.post("/abort_request", json={})).status_code == 400
        assert (await c.post("/abort_request", json={"rid": "gone"})).json()["success"] is False
        info = (await c.get("/get_model_info")).json()
        assert info["is_generation"] is True and info["weight_version"] == "0" and info["vocab_size"] == 64
        assert (await c.get("/get_server_info")).json()["backend"] == "miles"
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/health_generate")).status_code == 200
        engine.healthy = False
        assert (await c.get("/health")).status_code == 503
    run_with(engine, go)


def test_client_reads_per_token_versions_across_an_in_place_update() -> None:
    async def main() -> None:
        engine = FakeEngine(step_delay=0.01, moe=True)
        client = HttpEngine("http://srv", transport=httpx.ASGITransport(app=create_engine_app(engine)))
        await client.connect()
        assert [m.name for m in client.weight_metadata()] == ["embed.weight", "head.bias"]
        req = GenerateRequest([5, 6], SamplingParams(max_new_tokens=40), session_id="s1", return_routed_experts=True)
        task = asyncio.create_task(client.generate(req))
        await asyncio.sleep(0.15)
        await client.pause("in_place")
        assert await client.update_weights({"head.bias": torch.ones(64)}) == 1
        await client.resume()
        res = await task
        assert res.finish_reason == "length" and len(res.output_ids) == 40 and res.request_id == req.request_id
        assert res.weight_versions[0] == 0 and res.weight_versions[-1] == 1
        assert res.weight_versions == sorted(res.weight_versions) and res.info["weight_versions_exact"]
        assert res.routed_experts is not None and len(res.routed_experts) == 40 and len(res.routed_experts[0]) == 3
        with pytest.raises(ValueError, match="out of vocabulary"):
            await client.generate(GenerateRequest([500]))
        assert client.weight_version == 1 and await client.health()
        await client.aclose()
    asyncio.run(main())


def test_real_uvicorn_on_an_ephemeral_loopback_port() -> None:
    import uvicorn

    async def main() -> None:
        engine = FakeEngine()
        sock = bind_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(create_engine_app(engine), log_level="warning"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        client = HttpEngine(f"http://127.0.0.1:{port}", retries=10, backoff_s=0.05)
        try:
            await client.connect()
            results = await asyncio.gather(*(client.generate(GenerateRequest([i + 1], SamplingParams(max_new_tokens=5)))
                                             for i in range(16)))
            assert all(len(r.output_ids) == 5 for r in results)
            async with httpx.AsyncClient() as raw:
                r = await raw.post(f"http://127.0.0.1:{port}/generate", json={"input_ids": [999]}, timeout=5)
            assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
            assert await client.health()
        finally:
            await client.aclose()
            server.should_exit = True
            await serving
        assert engine.closed
    asyncio.run(main())


def test_tied_weights_encode_for_the_tensor_route() -> None:
    """A trainer's export of a tied-embedding model holds two names over one storage (what a
    restarted engine process is restored with): both travel, equal."""
    import torch

    shared = torch.randn(8, 4)
    decoded = tensors.decode_named_tensors(tensors.encode_named_tensors(
        {"model.embed_tokens.weight": shared, "lm_head.weight": shared, "norm": torch.ones(4)}))
    assert torch.equal(decoded["lm_head.weight"], shared) and torch.equal(decoded["model.embed_tokens.weight"], shared)


def test_pause_wait_over_http_lets_the_running_request_finish_on_the_old_weights() -> None:
    from tests.engines.embedded.helpers import engine, greedy, prompt, req, wait_for_tokens

    async def main() -> None:
        eng = engine()
        client = HttpEngine("http://srv", transport=httpx.ASGITransport(app=create_engine_app(eng)))
        await client.connect()
        task = asyncio.create_task(client.generate(req(prompt(6, 0), greedy(60))))
        await wait_for_tokens(eng, 4)
        await client.pause("wait")  # answered once the running request is done
        assert eng.stats()["paused"] and eng.stats()["output_tokens"] == 60
        new = {m.name: eng.model.state_dict()[m.name] + 0.01 for m in eng.weight_metadata()[:2]}
        assert await client.update_weights(new, version=2) == 2
        await client.resume()
        first = await asyncio.wait_for(task, 60)
        assert first.finish_reason == "length" and first.weight_versions == [0] * 60
        assert (await client.generate(req(prompt(6, 1), greedy(3)))).weight_versions == [2] * 3
        await client.aclose()
        await eng.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("mode, effect", [("in_place", "kept_in_place"), ("retract", "retracted"), ("abort", "aborted")])
def test_a_pause_over_http_says_what_it_did_to_running_requests(mode: str, effect: str) -> None:
    """Our server answers a pause with what it did (``miles_pause``); the client and a router in front of
    it count it, so a run on server engines logs ``engines/<name>/kept_in_place`` like an embedded one."""
    from miles_engine.engines.router import Router
    from tests.engines.embedded.helpers import engine, greedy, prompt, req, wait_for_tokens

    async def main() -> None:
        eng = engine()
        client = HttpEngine("http://srv", name="srv", transport=httpx.ASGITransport(app=create_engine_app(eng)))
        await client.connect()
        router = Router({"srv": client})
        router.metrics()
        tasks = [asyncio.create_task(client.generate(req(prompt(6, i), greedy(80)))) for i in range(2)]
        await wait_for_tokens(eng, 4)
        await router.pause(mode)
        assert client.pause_counts == {**{k: 0 for k in ("retracted", "kept_in_place", "aborted")}, effect: 2}
        await router.resume()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert [r.finish_reason for r in results] == ["abort" if mode == "abort" else "length"] * 2
        figures = router.metrics()
        assert figures[f"engines/srv/{effect}"] == 2 and figures[f"engines/{effect}"] == 2
        assert router.metrics()[f"engines/srv/{effect}"] == 0  # counted once
        await client.aclose()
        await eng.aclose()

    asyncio.run(main())

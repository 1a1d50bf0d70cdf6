"""Our server's SGLang prefill-only scoring call over the embedded engine, and /v1/tokenize."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

from miles_engine.engines.embedded import load_engine
from miles_engine.run.engine_server import create_engine_app
from tests.teachers.helpers import make_model_dir, tiny_tokenizer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("scoring"), hidden=32, seed=2, tokenizer=tiny_tokenizer())


def _with_server(model_dir: Path, fn, *, tokenizer: bool = True):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        engine = load_engine(str(model_dir))
        app = create_engine_app(engine, model_path=str(model_dir) if tokenizer else None)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://srv") as c:
                return await fn(c, engine)
        finally:
            await engine.aclose()
    return asyncio.run(asyncio.wait_for(main(), 60))


def test_scoring_has_sglang_shape_and_values(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = [5, 9, 17, 33, 2, 40]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)

    async def go(c: httpx.AsyncClient, engine) -> None:  # type: ignore[no-untyped-def]
        r = await c.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                            "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 3,
                                            "token_ids_logprob": [1, 7], "rid": "s1"})
        assert r.status_code == 200, r.text
        out = r.json()
        meta = out["meta_info"]
        assert out["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
        assert (meta["id"], meta["prompt_tokens"], meta["completion_tokens"]) == ("s1", 6, 0)
        itl = meta["input_token_logprobs"]
        assert [e[1] for e in itl] == ids[2:] and itl[0] == [None, ids[2], None]  # SGLang's leading None
        for j, (lp, tid, text) in enumerate(itl[1:], start=3):
            assert text is None and abs(lp - ref[j - 1, tid].item()) < 1e-5
        top = meta["input_top_logprobs"]
        assert len(top) == 4 and top[0] is None
        for j, entries in enumerate(top[1:], start=3):
            assert [e[1] for e in entries] == torch.sort(ref[j - 1], descending=True, stable=True).indices[:3].tolist()
        asked = meta["input_token_ids_logprobs"]
        assert asked[0] is None and [[e[1] for e in row] for row in asked[1:]] == [[1, 7]] * 3
        assert abs(asked[1][1][0] - ref[2, 7].item()) < 1e-5
        assert meta["output_token_logprobs"] == [] and meta["output_top_logprobs"] == []
        # logprob_start_len -1 (default) on a prefill-only request: no input log-probs, as SGLang
        r = await c.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                            "return_logprob": True})
        assert r.json()["meta_info"]["input_token_logprobs"] == []
        assert engine.stats()["requests"] == 0  # scoring never enters the sampling scheduler
    _with_server(model_dir, go)


@pytest.mark.parametrize("extra, fragment", [
    ({"logprob_start_len": 6}, "logprob_start_len=6 is higher than the number of input tokens 6"),
    ({"logprob_start_len": -2}, "logprob_start_len must be an integer >= -1"),
    ({"top_logprobs_num": -1}, "top_logprobs_num must be an integer >= 0"),
    ({"token_ids_logprob": [1, "x"]}, "token_ids_logprob must be a list of integers"),
    ({"token_ids_logprob": [100000]}, "token_ids_logprob[0] = 100000 is out of vocabulary"),
    ({"input_ids": [1, 99999]}, "input_ids[1] = 99999 is out of vocabulary"),
    ({"frobnicate": 1}, "unknown request field"),
])
def test_bad_scoring_requests_are_400(model_dir: Path, extra: dict, fragment: str) -> None:
    async def go(c: httpx.AsyncClient, engine) -> None:  # type: ignore[no-untyped-def]
        body = {"input_ids": [5, 9, 17, 33, 2, 40], "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True, "logprob_start_len": 0, **extra}
        r = await c.post("/generate", json=body)
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    _with_server(model_dir, go)


def test_tokenize_like_sglang(model_dir: Path) -> None:
    tok = tiny_tokenizer()

    async def go(c: httpx.AsyncClient, engine) -> None:  # type: ignore[no-untyped-def]
        r = await c.post("/v1/tokenize", json={"prompt": ["echo hi", "<|im_start|>"], "add_special_tokens": False})
        assert r.json() == {"tokens": [tok.encode("echo hi"), [1]], "count": [len(tok.encode("echo hi")), 1],
                            "max_model_len": 256}
        assert (await c.post("/tokenize", json={"prompt": "echo hi"})).json()["tokens"] == tok.encode("echo hi")
        assert (await c.get("/get_model_info")).json()["tokenizer_vocab_size"] == tok.vocab_size
    _with_server(model_dir, go)


def test_no_tokenizer_and_no_scorer_are_named() -> None:
    from tests.engines.fakes import FakeEngine

    async def main() -> None:
        app = create_engine_app(FakeEngine())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://srv") as c:
            r = await c.post("/v1/tokenize", json={"prompt": "x"})
            assert r.status_code == 400 and "has no tokenizer" in r.json()["error"]["message"]
            r = await c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0},
                                                "return_logprob": True, "logprob_start_len": 0})
            assert r.status_code == 400 and "cannot score prompts" in r.json()["error"]["message"]
            r = await c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}})
            assert r.status_code == 200 and r.json()["output_ids"] == []  # nothing asked: nothing to score
    asyncio.run(asyncio.wait_for(main(), 30))

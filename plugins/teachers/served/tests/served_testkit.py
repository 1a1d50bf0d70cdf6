"""Test kit: the tiny model, a uvicorn server in a thread, and a fake SGLang server.

The fake follows sgl-project/sglang: ``GenerateReqInput`` fields; ``logprob_start_len`` -1 on a
prefill-only request meaning ``len(input_ids)``; input log-probs built as the scheduler does
(``[None]`` + the computed positions' log-probs, the last popped; ids ``input_ids[start:]``);
``[logprob, token_id, None]`` tuples; ``input_top_logprobs`` / ``input_token_ids_logprobs`` with
a leading ``None``; ``/get_model_info`` without a vocabulary size; ``/v1/tokenize``; the API key
middleware (``Authorization: Bearer``, 401 otherwise). ``app.state.faults`` injects failures.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Self

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CORPUS = ["echo hello world > greeting.txt", "the answer is 42\n", "ls -la /tmp && cat notes.md",
          "<|im_start|>user\nwhat is 17 * 3?<|im_end|>\n<|im_start|>assistant\n51<|im_end|>"] * 30


def tiny_tokenizer(vocab_size: int = 320):
    from miles_engine.models.tokenizer import TitoTokenizer
    from miles_engine.models.bpe import BPE_ADDED_TOKENS
    from miles_engine.models.bpe import train_bpe

    return TitoTokenizer(train_bpe(CORPUS, vocab_size=vocab_size, added=BPE_ADDED_TOKENS["chatml"]), name="tiny")


def make_model_dir(root: Path, *, hidden: int = 64, seed: int = 0, tokenizer=None) -> Path:
    from miles_engine.models.tiny import TinyModelConfig, build_config, build_model

    tok = tokenizer or tiny_tokenizer()
    cfg = build_config(TinyModelConfig(hidden_size=hidden, num_hidden_layers=1, intermediate_size=2 * hidden,
                                       head_dim=16, max_position_embeddings=256),
                       tok.vocab_size, bos_id=None, eos_id=None, pad_id=None)
    build_model(cfg, seed).save_pretrained(str(root))
    tok.backend.save(str(root / "tokenizer.json"))
    return root


class ServerThread:
    """Serve an ASGI app with uvicorn on 127.0.0.1 (a free port) in a thread; stop on exit."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        from miles_engine.run.engine_server import bind_socket

        self.sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"test server at {self.url} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def fake_sglang_app(model_dir: Path, tokenizer: Any, *, api_key: str | None = None) -> Any:
    import torch
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    app = FastAPI()
    app.state.faults = []  # consumed one per /generate: "503", "drop", "short", "shift", "garbage", "400"
    app.state.generate_calls = 0
    app.state.scoring_calls = 0

    @app.middleware("http")
    async def authentication(request: Request, call_next):  # type: ignore[no-untyped-def]
        if api_key and request.headers.get("Authorization") != f"Bearer {api_key}":
            return JSONResponse(content={"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {"model_path": str(model_dir), "tokenizer_path": str(model_dir), "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default"}

    @app.post("/v1/tokenize")
    async def tokenize(body: dict[str, Any]) -> dict[str, Any]:
        special = body.get("add_special_tokens", True)
        enc = lambda t: tokenizer.backend.encode(t, add_special_tokens=special).ids
        prompt = body["prompt"]
        if isinstance(prompt, str):
            return {"tokens": enc(prompt), "count": len(enc(prompt)), "max_model_len": 256}
        rows = [enc(p) for p in prompt]
        return {"tokens": rows, "count": [len(r) for r in rows], "max_model_len": 256}

    def tuples(vals: list[Any], idxs: list[Any]) -> list[Any]:  # detokenize_logprob_tokens, text off
        return [(v, i, None) for v, i in zip(vals, idxs)]

    @app.post("/generate")
    async def generate(body: dict[str, Any]) -> Any:
        fault = app.state.faults.pop(0) if app.state.faults else None
        if fault == "503":
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        if fault == "400":
            return JSONResponse({"object": "error", "message": "bad request from the fake", "code": 400}, status_code=400)
        if fault == "garbage":
            return JSONResponse(["not", "an", "object"])
        ids = body["input_ids"]
        sp = body.get("sampling_params") or {}
        if sp.get("max_new_tokens") != 0:
            app.state.generate_calls += 1
            return JSONResponse({"error": {"message": "the fake only scores"}}, status_code=400)
        app.state.scoring_calls += 1
        start = body.get("logprob_start_len", -1)
        start = len(ids) if start == -1 else start
        top_n = body.get("top_logprobs_num") or 0
        asked = body.get("token_ids_logprob")
        with torch.inference_mode():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)[start:]
        chosen = logp[:-1].gather(1, torch.tensor(ids[start + 1:])[:, None]).squeeze(1).tolist() if len(logp) else []
        vals = [None, *chosen, None][:len(ids) - start + 1]
        vals.pop()  # "The last input logprob is for sampling, so just pop it out."
        meta: dict[str, Any] = {"id": "fake", "finish_reason": {"type": "length", "length": 0},
                                "prompt_tokens": len(ids), "completion_tokens": 0, "cached_tokens": 0,
                                "weight_version": "default"}
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = tuples(vals, ids[start:])
            meta["output_token_logprobs"] = []
            if top_n:
                vals_k, idx_k = torch.topk(logp, top_n, dim=-1)
                rows = [None, *(tuples(v, i) for v, i in zip(vals_k.tolist(), idx_k.tolist()))]
                rows.pop()
                meta["input_top_logprobs"], meta["output_top_logprobs"] = rows, []
            if asked is not None:
                sel = logp.index_select(1, torch.tensor(asked)).tolist()
                rows = [None, *(tuples(v, asked) for v in sel)]
                rows.pop()
                meta["input_token_ids_logprobs"], meta["output_token_ids_logprobs"] = rows, []
        if fault == "drop":
            meta.pop("input_token_logprobs", None)
        elif fault == "short":
            meta["input_token_logprobs"] = meta["input_token_logprobs"][:-1]
        elif fault == "shift":  # an off-by-one server: entries for input_ids[start + 1:] + one more
            meta["input_token_logprobs"] = [[-1.0, t, None] for t in [*ids[start + 1:], ids[-1]]]
        return {"text": "", "output_ids": [], "meta_info": meta}

    return app

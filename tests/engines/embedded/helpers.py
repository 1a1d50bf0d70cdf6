"""Shared helpers: tiny configs, a bounded asyncio runner, teacher-forced references."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable
from typing import Any, TypeVar

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from miles_engine.engines.embedded.engine import EmbeddedEngine  # noqa: E402
from miles_engine.engines.embedded.sampler import RowParams, filtered_logprobs  # noqa: E402
from miles_engine.engines.protocol import GenerateRequest, GenerateResult, SamplingParams  # noqa: E402

T = TypeVar("T")

DENSE = dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
             eos_token_id=None, bos_token_id=None, pad_token_id=None)
MOE = dict(DENSE, model_type="qwen3_moe", moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


def run(coro: Awaitable[T], timeout: float = 60.0) -> T:
    """asyncio.run with a hard bound."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def engine(config: dict[str, Any] | None = None, **kw: Any) -> EmbeddedEngine:
    kw.setdefault("max_context", 512)
    return EmbeddedEngine.from_model(dict(config or DENSE), num_threads=1, **kw)


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)


def req(ids: list[int], sampling: SamplingParams | None = None, **kw: Any) -> GenerateRequest:
    return GenerateRequest(input_ids=list(ids), sampling=sampling or greedy(8), **kw)


def prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def teacher_forced(model: Any, prompt_ids: list[int], res: GenerateResult, sp: SamplingParams) -> list[float]:
    """Log-probs of the output tokens from one full forward pass over prompt + output,
    under the same temperature / top-k / top-p filtering the engine reports."""
    ids = torch.tensor([prompt_ids + res.output_ids[:-1]])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    p = len(prompt_ids)
    rows = logits[p - 1 : p - 1 + len(res.output_ids)]
    params = [RowParams(sp.temperature, sp.top_p, sp.top_k)] * rows.shape[0]
    logp = filtered_logprobs(rows, params)
    return logp.gather(1, torch.tensor(res.output_ids)[:, None]).squeeze(1).tolist()


async def wait_for_tokens(eng: EmbeddedEngine, n: int, timeout: float = 20.0) -> None:
    """Wait until the engine has sampled at least ``n`` tokens in total."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while eng.stats()["output_tokens"] < n:
        if loop.time() > end:
            raise TimeoutError(f"engine produced {eng.stats()['output_tokens']} < {n} tokens")
        await asyncio.sleep(0.002)

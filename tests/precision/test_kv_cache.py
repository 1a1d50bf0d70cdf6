"""The FP8 KV cache: keys and values stored and attended as E4M3 with a float32 scale per token and
head -- bit-exact against the reference, in generation, in the prompt cache and in prompt scoring alike."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from miles_engine.engines.embedded import EmbeddedEngine
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.precision.quantizer import kv_fp8
from miles_engine.trainer.models import build_causal_lm
from tests.precision import reference as ref
from tests.trainer.helpers import TINY


def test_kv_fp8_matches_the_reference_per_token_and_head():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 16, generator=g) * torch.exp(torch.randn(2, 3, 5, 1, generator=g) * 3)
    x[0, 0, 0] = 0.0
    x[0, 1, 2, 3] = math.nan
    x[1, 2, 4, 0] = math.inf
    got = kv_fp8(x)
    for vec, out in zip(x.reshape(-1, 16).tolist(), got.reshape(-1, 16).tolist()):
        codes, scale = ref.fp8_tile(vec)
        if math.isnan(scale):
            assert all(math.isnan(o) for o in out)
            continue
        want = [float(ref.e4m3_value(c)) * scale for c in codes]
        assert out == [float(ref.f32(ref.e4m3_value(c) * ref.Fraction(scale))) for c in codes] or out == want
    assert kv_fp8(x.to(torch.bfloat16)).dtype == torch.bfloat16


async def _greedy(engine: EmbeddedEngine, prompt: list[int]) -> tuple[list[int], list[float]]:
    res = await engine.generate(GenerateRequest(prompt, SamplingParams(temperature=0.0, max_new_tokens=12)))
    return res.output_ids, res.output_logprobs


def test_generation_prompt_cache_and_scoring_read_the_same_fp8_values():
    model = build_causal_lm(TINY, torch.device("cpu"), 0)
    prompt = torch.randint(0, TINY["vocab_size"], (20,), generator=torch.Generator().manual_seed(1)).tolist()

    async def main():
        fp8 = EmbeddedEngine.from_model(model, kv_cache="fp8")
        full = EmbeddedEngine.from_model(model)
        try:
            ids, logp = await _greedy(fp8, prompt)
            again_ids, again_logp = await _greedy(fp8, prompt)  # its prefill comes from the shared-prompt cache
            assert again_ids == ids and max(abs(a - b) for a, b in zip(again_logp, logp)) < 1e-5
            assert fp8.stats().get("prompt_cache_hits", 1) >= 1
            scored = (await fp8.score_prompt(prompt + ids, len(prompt) - 1)).token
            assert max(abs(a - b) for a, b in zip(scored, logp)) < 1e-4  # scoring reads the fp8 cache too
            full_scored = (await full.score_prompt(prompt + ids, len(prompt) - 1)).token
            assert max(abs(a - b) for a, b in zip(full_scored, logp)) > 1e-4  # and the format is in effect
        finally:
            await fp8.aclose()
            await full.aclose()
    asyncio.run(main())


def test_an_unknown_kv_format_is_one_error():
    with pytest.raises(Exception, match="kv_cache"):
        EmbeddedEngine.from_model(dict(TINY), kv_cache="fp4")

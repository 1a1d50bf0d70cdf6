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


def test_the_fp8_cache_holds_codes_and_scales_and_attention_reads_their_values():
    """Stored: a vector's E4M3 codes then its float32 scale's bytes (``head_dim + 4`` bytes, not
    ``4 * head_dim``); read: exactly kv_fp8's values; a row copied out (the session and prompt
    caches) and loaded back reads the same."""
    from miles_engine.engines.embedded.kv_cache import RaggedKV
    from miles_engine.engines.embedded.kv_codec import FP8KVCodec

    g = torch.Generator().manual_seed(0)
    key = torch.randn(3, 2, 5, 16, generator=g) * torch.exp(torch.randn(3, 2, 5, 1, generator=g) * 3)
    value = torch.randn(3, 2, 5, 16, generator=g)
    key[0, 0, 0, 3], key[1, 1, 2] = math.nan, 0.0

    def fill(cache: RaggedKV) -> tuple[torch.Tensor, torch.Tensor]:
        cache.load_prefix([None] * 3)
        cache.begin_forward(torch.ones(3, 5, dtype=torch.bool), torch.arange(5).expand(3, 5))
        out = cache.layers[0].update(key, value)
        cache.end_forward()
        return out

    packed = RaggedKV(1, device="cpu", dtype=torch.float32, kv_codec=FP8KVCodec())
    plain = RaggedKV(1, device="cpu", dtype=torch.float32)
    keys, values = fill(packed)
    fill(plain)
    torch.testing.assert_close(keys, kv_fp8(key), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(values, kv_fp8(value), rtol=0, atol=0, equal_nan=True)
    assert packed.k[0].dtype == torch.uint8 and packed.k[0].shape[-1] == 16 + 4
    assert packed.nbytes() * 4 * 16 == plain.nbytes() * (16 + 4)

    ks, vs, _ = packed.row_tokens(2)
    again = RaggedKV(1, device="cpu", dtype=torch.float32, kv_codec=FP8KVCodec())
    again.load_prefix([(ks, vs)])
    again.begin_forward(torch.ones(1, 1, dtype=torch.bool), torch.tensor([[5]]))
    k2, v2 = again.layers[0].update(key[2:, :, :1], value[2:, :, :1])
    torch.testing.assert_close(k2[0, :, :5], kv_fp8(key[2]), rtol=0, atol=0)
    torch.testing.assert_close(v2[0, :, 5:], kv_fp8(value[2:, :, :1])[0], rtol=0, atol=0)


def test_an_fp8_engine_holds_a_kv_vector_in_head_dim_plus_4_bytes():
    model = build_causal_lm(TINY, torch.device("cpu"), 0)
    head_dim = TINY["head_dim"]
    prompts = [torch.randint(0, TINY["vocab_size"], (24,), generator=torch.Generator().manual_seed(s)).tolist()
               for s in range(4)]

    async def main():
        fp8 = EmbeddedEngine.from_model(model, kv_cache="fp8")
        full = EmbeddedEngine.from_model(model)
        try:
            for engine in (fp8, full):
                await asyncio.gather(*(_greedy(engine, p) for p in prompts))
            def bytes_per_vector(engine: EmbeddedEngine) -> float:
                batch = engine._runner.batch  # its geometry depends on how requests met: per vector held
                vectors = 2 * TINY["num_hidden_layers"] * TINY["num_key_value_heads"] * batch.row_cap * batch.col_cap
                return engine.stats()["kv_batch_bytes"] / vectors

            assert bytes_per_vector(fp8) == head_dim + 4 and bytes_per_vector(full) == 4 * head_dim
        finally:
            await fp8.aclose()
            await full.aclose()
    asyncio.run(main())

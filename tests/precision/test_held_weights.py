"""The engine holds quantised weights in their format (codes and scales, no full-precision copy)
and computes with exactly the quantizer's values: the same log-probs, bit for bit, as an engine
whose float weights were set to those values; parts of an update are stored as they came."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles_engine.engines.embedded import EmbeddedEngine
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.precision.parts import to_parts
from miles_engine.precision.quantizer import dequantize, quantize
from miles_engine.precision.targets import quantized_weights
from miles_engine.trainer.models import build_causal_lm
from tests.trainer.helpers import MOE, TINY

EXCEPTIONS = ("model.layers.1.mlp.*",)


def _snapped(model: torch.nn.Module, fmt: str, config: dict = TINY) -> torch.nn.Module:
    """A copy of ``model`` whose float weights are the quantizer's values (what the engine held before)."""
    twin = build_causal_lm(config, torch.device("cpu"), 0)
    state = model.state_dict()
    chosen = quantized_weights(model, fmt, EXCEPTIONS)
    twin.load_state_dict({n: dequantize(quantize(t, fmt, n)) if n in chosen else t for n, t in state.items()})
    return twin


async def _sample(engine: EmbeddedEngine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    results = await asyncio.gather(*(engine.generate(GenerateRequest(p, SamplingParams(
        temperature=1.0, max_new_tokens=16, seed=i))) for i, p in enumerate(prompts)))
    return [(r.output_ids, r.output_logprobs) for r in results]


@pytest.mark.parametrize("config", [TINY, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "nvfp4", "int4"])
def test_held_weights_compute_exactly_the_quantizers_values_in_fewer_bytes(fmt: str, config: dict) -> None:
    """A MoE model's stacked experts are held too (each expert quantised as its own weight)."""
    model = build_causal_lm(config, torch.device("cpu"), 0)
    prompts = [torch.randint(0, TINY["vocab_size"], (12,), generator=torch.Generator().manual_seed(s)).tolist()
               for s in range(4)]

    async def main() -> None:
        held = EmbeddedEngine.from_model(model, weight_format=fmt, weight_exceptions=EXCEPTIONS)
        values = EmbeddedEngine.from_model(_snapped(model, fmt, config))
        try:
            chosen = quantized_weights(model, fmt, EXCEPTIONS)
            params = dict(held.model.named_parameters())
            assert chosen and not set(chosen) & set(params)  # no full-precision copy of a held weight
            assert (config is TINY) != ("model.layers.0.mlp.experts.gate_up_proj" in chosen)
            assert await _sample(held, prompts) == await _sample(values, prompts)  # bit for bit
            full_bytes = sum(model.state_dict()[n].numel() * 4 for n in chosen)
            saved = values.stats()["weight_bytes"] - held.stats()["weight_bytes"]
            quantised = sum(quantize(model.state_dict()[n], fmt, n).nbytes for n in chosen)
            assert saved == full_bytes - quantised > 0
            meta = {m.name: m for m in held.weight_metadata()}
            assert all(meta[n].format == fmt and meta[n].dtype == "float32" and meta[n].shape == tuple(
                model.state_dict()[n].shape) for n in chosen)  # what a trainer sends is unchanged
        finally:
            await held.aclose()
            await values.aclose()
    asyncio.run(main())


def test_an_update_stores_parts_as_they_came_and_quantises_whole_tensors_once() -> None:
    model = build_causal_lm(TINY, torch.device("cpu"), 0)
    name, whole = "model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"

    async def main() -> None:
        engine = EmbeddedEngine.from_model(model, weight_format="nvfp4")
        try:
            g = torch.Generator().manual_seed(3)
            new = torch.randn(model.state_dict()[name].shape, generator=g)
            parts = dict(to_parts(name, new, "nvfp4"))
            plain = torch.randn(model.state_dict()[whole].shape, generator=g)
            assert await engine.update_weights({**parts, whole: plain}) == 1
            stored = engine._held.handles[name].quantized
            assert stored.codes is parts[f"{name}:q.codes"] and stored.scales is parts[f"{name}:q.scales"]
            assert torch.equal(engine.model.state_dict()[name], dequantize(quantize(new, "nvfp4")))
            assert torch.equal(engine._held.handles[whole].quantized.codes, quantize(plain, "nvfp4").codes)
            assert torch.equal(engine.model.state_dict()[whole], dequantize(quantize(plain, "nvfp4")))
        finally:
            await engine.aclose()
    asyncio.run(main())


def test_weight_storage_values_keeps_the_decoded_values_and_the_same_numbers() -> None:
    """``weight_storage: values``: decoded once per update (full memory, no decode per forward), the
    same tokens and log-probs as codes storage."""
    model = build_causal_lm(TINY, torch.device("cpu"), 0)
    prompts = [torch.randint(0, TINY["vocab_size"], (12,), generator=torch.Generator().manual_seed(s)).tolist()
               for s in range(3)]

    async def main() -> None:
        codes = EmbeddedEngine.from_model(model, weight_format="fp8")
        values = EmbeddedEngine.from_model(model, weight_format="fp8", weight_storage="values")
        try:
            assert await _sample(codes, prompts) == await _sample(values, prompts)
            assert values.stats()["weight_bytes"] > codes.stats()["weight_bytes"]
            g = torch.Generator().manual_seed(5)
            name = "model.layers.0.mlp.up_proj.weight"
            new = torch.randn(model.state_dict()[name].shape, generator=g)
            for engine in (codes, values):
                await engine.update_weights(dict(to_parts(name, new, "fp8")))
                assert torch.equal(engine.model.state_dict()[name], dequantize(quantize(new, "fp8")))
            assert await _sample(codes, prompts) == await _sample(values, prompts)
        finally:
            await codes.aclose()
            await values.aclose()
    asyncio.run(main())

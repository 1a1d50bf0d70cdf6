"""weights.check_update_equal learns the formats: an engine that holds the quantizer's values
publishes each tensor's format, and the check compares against the trainer's tensor as that
engine must hold it -- in-process and across HTTP (a server engine over the broadcast transport)."""

from __future__ import annotations

import json

import pytest
import torch

from miles_engine.engines.embedded.engine import EmbeddedEngine
from miles_engine.engines.http.client import HttpEngine
from miles_engine.precision.quantizer import dequantize, quantize
from miles_engine.weights import create_transport
from miles_engine.weights.check import CheckOptions, WeightCheckError
from miles_engine.weights.check.transport import CheckedTransport
from tests.rollout.helpers import run
from tests.weights.check_helpers import Alter
from tests.weights.helpers import TINY_QWEN3, engine_process, trainer_model

TARGET = "model.layers.0.mlp.up_proj.weight"


def test_colocated_check_passes_on_a_quantised_engine_and_names_a_lossy_load():
    trainer = trainer_model(seed=3)
    engine = EmbeddedEngine.from_model(dict(TINY_QWEN3), num_threads=1, max_context=128, weight_format="mxfp8")
    meta = {m.name: m for m in engine.weight_metadata()}
    assert meta[TARGET].format == "mxfp8" and meta["model.embed_tokens.weight"].format is None

    def double_one(name: str, t: torch.Tensor) -> torch.Tensor:
        if name != TARGET:
            return t
        t = t.clone()
        t.view(-1)[0] *= 4  # moves its block's scale: a different quantised tensor
        return t

    async def main():
        ok = create_transport("colocated", engine, check=CheckOptions())
        stats = await ok.push(trainer.named_parameters(), version=1)
        assert stats.tensors_checked == len(dict(trainer.named_parameters()))
        held = engine.model.state_dict()[TARGET]
        assert torch.equal(held, dequantize(quantize(trainer.state_dict()[TARGET], "mxfp8")))
        assert not torch.equal(held, trainer.state_dict()[TARGET])  # it is quantised, and the check knew
        lossy = CheckedTransport(Alter(create_transport("colocated", engine), double_one), engine, CheckOptions())
        with pytest.raises(WeightCheckError, match=f"'{TARGET}' differs"):
            await lossy.push(trainer.named_parameters(), version=2)
        await engine.aclose()
    run(main(), 60)


@pytest.mark.timeout(150)
def test_a_server_engine_publishes_its_format_and_the_broadcast_check_passes(tmp_path):
    trainer = trainer_model(seed=5)

    async def main(url: str):
        engine = await HttpEngine(url, name="engine-proc").connect()
        meta = {m.name: m for m in engine.weight_metadata()}
        assert meta[TARGET].format == "nvfp4"
        assert meta["model.layers.0.mlp.down_proj.weight"].format is None  # an exception
        transport = CheckedTransport(create_transport("broadcast", engine, bucket_bytes=16 << 10, backend="gloo",
                                                      timeout_s=30, group_name="check-nvfp4"),
                                     engine, CheckOptions())
        stats = await transport.push(trainer.named_parameters(), version=1)
        assert stats.tensors_checked == len(dict(trainer.named_parameters()))
        await transport.close()
    options = json.dumps({"weight_format": "nvfp4", "weight_exceptions": ["*.down_proj.*"]})
    with engine_process(tmp_path, "--engine-options", options, start_s=75) as proc:
        run(main(proc.url), 140)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "nvfp4", "int4"])
def test_the_export_ships_codes_and_scales_and_the_engine_joins_them(fmt):
    from miles_engine.precision.parts import part_specs, to_parts
    from miles_engine.weights.tensors import check_received, conform

    trainer = trainer_model(seed=7)
    engine = EmbeddedEngine.from_model(dict(TINY_QWEN3), num_threads=1, max_context=128, weight_format=fmt)
    named = dict(trainer.named_parameters())
    shipped = dict(conform(named.items(), engine.weight_metadata(), "test"))
    assert f"{TARGET}:q.codes" in shipped and TARGET not in shipped
    assert check_received({n: (str(t.dtype), t.shape) for n, t in shipped.items()}, engine.weight_metadata()) == []

    async def main():
        stats = await create_transport("colocated", engine).push(named.items(), version=1)
        full = sum(t.numel() * t.element_size() for t in named.values())
        assert stats.bytes < full and stats.missing == len({m.name for m in engine.weight_metadata()} - named.keys())
        held = engine.model.state_dict()
        assert torch.equal(held[TARGET], dequantize(quantize(named[TARGET].detach(), fmt)))
        bad = dict(to_parts(TARGET, named[TARGET].detach(), fmt))
        bad[f"{TARGET}:q.scales"] = bad[f"{TARGET}:q.scales"].to(torch.float64)
        with pytest.raises(Exception, match=r"refused, nothing was changed: .*q\.scales"):
            await engine.update_weights(bad)
        missing = dict(to_parts(TARGET, named[TARGET].detach(), fmt))
        missing.pop(f"{TARGET}:q.codes")
        with pytest.raises(Exception, match="part .*q.codes' is missing"):
            await engine.update_weights(missing)
        with pytest.raises(Exception, match="arrives quantised but this engine holds in full precision"):
            await engine.update_weights(dict(to_parts("model.embed_tokens.weight", held["model.embed_tokens.weight"],
                                                      fmt)))
        assert torch.equal(engine.model.state_dict()[TARGET], held[TARGET])  # nothing changed
        assert set(part_specs(TARGET, tuple(named[TARGET].shape), fmt)) == {n for n in shipped if n.startswith(TARGET)}
        await engine.aclose()
    run(main(), 60)


def test_a_moe_trainer_and_engine_compute_with_the_same_quantised_experts():
    """QAT on a MoE (the stacked experts fake-quantised expert by expert), a push of codes and
    scales into an engine holding them, every tensor checked; the engine's log-probs of its own
    sampled tokens are the trainer's."""
    import copy

    from miles_engine.engines.protocol import GenerateRequest, SamplingParams
    from miles_engine.trainer.models import build_causal_lm
    from miles_engine.trainer.torch_trainer import TorchTrainer
    from miles_engine.weights.check import CheckOptions
    from tests.trainer.helpers import MOE

    model = build_causal_lm(dict(MOE), torch.device("cpu"), 0)
    trainer = TorchTrainer(copy.deepcopy(model), {"weight_format": "fp8", "optimizer": {"lr": 1e-2}})
    trainer.sft_step([([1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 1, 1, 1, 1])])
    engine = EmbeddedEngine.from_model(copy.deepcopy(model), num_threads=1, max_context=128, weight_format="fp8")
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert {m.name: m.format for m in engine.weight_metadata()}[experts] == "fp8"

    async def main():
        transport = create_transport("colocated", engine, check=CheckOptions())
        named = dict(trainer.named_tensors())
        stats = await transport.push(list(named.items()), version=1)
        assert stats.tensors_checked == len(named) and stats.bytes < sum(t.numel() * 4 for t in named.values())
        assert torch.equal(engine.model.state_dict()[experts], dequantize(quantize(named[experts], "fp8")))
        prompt = [3, 1, 4, 1, 5, 9, 2, 6]
        res = await engine.generate(GenerateRequest(prompt, SamplingParams(temperature=1.0, max_new_tokens=8, seed=1)))
        theirs = trainer.compute_logprobs([(prompt + res.output_ids, [0] * len(prompt) + [1] * len(res.output_ids))])
        gap = max(abs(a - b) for a, b in zip(theirs[0][len(prompt):], res.output_logprobs))
        assert gap < 1e-5, gap  # experts held in full precision by the engine alone: 6e-4
        await transport.close()
        await engine.aclose()
    run(main(), 60)

"""The stages of the precision contract agree: the engine holds exactly the quantizer's values (at
load and after every update), the trainer's quantisation-aware forward computes with the same
bytes, and the recipe refuses pairs and overrides that would let two stages differ."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles_engine.config.recipe import RecipeConfig
from miles_engine.engines.embedded import EmbeddedEngine
from miles_engine.errors import ConfigError
from miles_engine.precision.quantizer import dequantize, fake_quantize, quantize
from miles_engine.precision.targets import quantized_weights
from miles_engine.trainer.models import build_causal_lm, forward_logprobs
from miles_engine.trainer.torch_trainer import TorchTrainer
from tests.trainer.helpers import TINY

BASE = {"environment": {"name": "shell-drills"}}


def recipe(**sections) -> RecipeConfig:
    return RecipeConfig.model_validate({**BASE, **sections})


@pytest.mark.parametrize("train,rollout", [("full", "full"), ("full", "fp8"), ("full", "mxfp8"), ("full", "int4"),
                                           ("fp8", "fp8"), ("mxfp8", "mxfp8"), ("nvfp4", "nvfp4"), ("int4", "int4")])
def test_valid_pairs_load_and_reach_the_trainer(train, rollout):
    cfg = recipe(precision={"train": train, "rollout": rollout, "exceptions": ["model.layers.1.*"]})
    assert cfg.trainer.weight_format == train and cfg.trainer.weight_exceptions == ["model.layers.1.*"]
    again = RecipeConfig.model_validate(cfg.model_dump(mode="json"))  # a run's config.yaml loads again
    assert again.precision == cfg.precision


@pytest.mark.parametrize("precision,rule", [
    ({"rollout": "nvfp4"}, "NVFP4 must be used in every stage"),
    ({"train": "nvfp4", "rollout": "full"}, "NVFP4 must be used in every stage"),
    ({"train": "fp8", "rollout": "full"}, "a quantised trainer needs the same format in rollout"),
    ({"train": "mxfp8", "rollout": "fp8"}, "a quantised trainer needs the same format in rollout"),
    ({"rollout": "fp4"}, "'full', 'fp8', 'mxfp8', 'nvfp4' or 'int4'"),
])
def test_invalid_pairs_are_one_error_naming_the_keys_and_the_rule(precision, rule):
    with pytest.raises(ValueError, match=rule) as err:
        recipe(precision=precision)
    assert "precision" in str(err.value)


@pytest.mark.parametrize("sections,key", [
    ({"trainer": {"weight_format": "fp8"}}, "trainer.weight_format"),
    ({"precision": {"rollout": "fp8", "exceptions": ["*.mlp.*"]}, "trainer": {"weight_exceptions": ["*.o_proj.*"]}},
     "trainer.weight_exceptions"),
    ({"engines": [{"kind": "server", "options": {"quantization": "fp8"}}]}, "engines.0.options.quantization"),
    ({"engines": [{"kind": "sglang", "options": {"extra_args": ["--kv-cache-dtype", "fp8_e4m3"]}}]},
     "engines.0.options.extra_args --kv-cache-dtype"),
])
def test_a_stage_only_override_is_refused(sections, key):
    with pytest.raises(ValueError, match=f"{key} would set one stage's precision alone"):
        recipe(**sections)


def test_contract_refusals_that_name_what_is_missing():
    with pytest.raises(ValueError, match="trainer.lora.enabled"):
        recipe(precision={"train": "fp8", "rollout": "fp8"}, trainer={"lora": {"enabled": True}})
    with pytest.raises(ValueError, match="true_on_policy=true needs the trainer and the engines"):
        recipe(precision={"rollout": "fp8"}, trainer={"true_on_policy": True})
    assert recipe(precision={"rollout": "fp8", "kv_cache": "fp8"}).precision.kv_cache == "fp8"


def loaded(tmp_path, **sections) -> RecipeConfig:
    import yaml

    from miles_engine.config.recipe import load_recipe
    from miles_engine.hub import default_hub

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**BASE, "weights": {"transport": "broadcast"}, **sections}))
    return load_recipe(path, hub=default_hub())


@pytest.mark.parametrize("precision,engine,why", [
    ({"rollout": "fp8"}, {"kind": "sglang", "device": "cuda", "dtype": "float32"},
     r"engines.0.kind='sglang': .*dtype 'float32': SGLang's FP8 linear kernels take bfloat16"),
    ({"rollout": "fp8"}, {"kind": "sglang", "dtype": "bfloat16"}, r"gloo \(the CPU backend\) cannot carry float8"),
    ({"rollout": "nvfp4", "train": "nvfp4"}, {"kind": "sglang", "device": "cuda", "dtype": "bfloat16"},
     r"sglang engines receive full, fp8"),
    ({"kv_cache": "fp8"}, {"kind": "sglang"}, "engines.0.kind='sglang': .*kv_cache='fp8'"),
    ({"kv_cache": "fp8"}, {"kind": "external", "options": {"urls": ["http://127.0.0.1:1"]}}, "engines.0.kind='external': .*do not receive the precision contract"),
    ({"rollout": "mxfp8"}, {"kind": "vllm", "dtype": "bfloat16"},
     r"engines.0.kind='vllm': precision.rollout='mxfp8': vllm engines receive full, fp8"),
    ({"rollout": "fp8", "kv_cache": "fp8"}, {"kind": "vllm", "dtype": "bfloat16"},
     r"precision.kv_cache='fp8': vLLM's FP8 KV cache \(--kv-cache-dtype fp8\) scales a whole layer"),
    ({"rollout": "fp8"}, {"kind": "vllm"}, r"dtype 'float32': vLLM's FP8 linear kernels take bfloat16"),
])
def test_engine_kinds_refuse_a_contract_they_cannot_hold_at_load(tmp_path, precision, engine, why):
    with pytest.raises(ConfigError, match=rf"recipe.yaml:\d+: .*{why}"):
        loaded(tmp_path, precision=precision, engines=[engine])


def test_vllm_and_sglang_engines_take_bf16_activations_with_fp8_weights(tmp_path):
    cfg = loaded(tmp_path, precision={"rollout": "fp8"}, engines=[{"kind": "vllm", "dtype": "bfloat16"}])
    assert cfg.precision.rollout == "fp8" and cfg.engines[0].kind == "vllm"
    cfg = loaded(tmp_path, precision={"rollout": "fp8"},
                 engines=[{"kind": "sglang", "device": "cuda", "dtype": "bfloat16"}])
    assert cfg.engines[0].kind == "sglang"


def engine(model, fmt: str, exceptions: tuple[str, ...] = ()) -> EmbeddedEngine:
    return EmbeddedEngine.from_model(model, weight_format=fmt, weight_exceptions=exceptions)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "nvfp4", "int4"])
def test_the_engine_holds_the_quantizers_values_at_load_and_after_an_update(fmt):
    model = build_causal_lm(TINY, torch.device("cpu"), 0)
    eng = engine(model, fmt, exceptions=("model.layers.1.mlp.*",))
    try:
        source = model.state_dict()
        chosen = quantized_weights(model, fmt, ("model.layers.1.mlp.*",))
        assert "model.layers.0.mlp.down_proj.weight" in chosen and "model.layers.1.mlp.down_proj.weight" not in chosen
        held = eng.model.state_dict()
        for name, t in source.items():
            want = dequantize(quantize(t, fmt, name)) if name in chosen else t
            assert torch.equal(held[name], want), name
        g = torch.Generator().manual_seed(1)
        update = {n: torch.randn(t.shape, generator=g) for n, t in source.items()
                  if t.dim() == 2 and n != "lm_head.weight"}  # tied to the embeddings
        asyncio.run(eng.update_weights(update))
        held = eng.model.state_dict()
        for name, t in update.items():
            want = dequantize(quantize(t, fmt, name)) if name in chosen else t
            assert torch.equal(held[name], want), name
    finally:
        asyncio.run(eng.aclose())


def test_a_weight_the_format_cannot_hold_is_one_error_naming_it():
    model = build_causal_lm(dict(TINY, intermediate_size=48), torch.device("cpu"), 0)
    with pytest.raises(ConfigError, match=r"down_proj\.weight \(64, 48\).*precision\.exceptions"):
        engine(model, "mxfp8")
    engine_ok = engine(model, "mxfp8", exceptions=("*.down_proj.weight",))
    asyncio.run(engine_ok.aclose())


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_trainer_and_engine_compute_with_the_same_bytes(fmt):
    trainer = TorchTrainer(TINY, {"weight_format": fmt})
    eng = engine(build_causal_lm(TINY, torch.device("cpu"), 1), "full")
    eng_q = engine(build_causal_lm(TINY, torch.device("cpu"), 1), fmt)
    try:
        for e in (eng, eng_q):
            asyncio.run(e.update_weights(dict(trainer.named_tensors())))
        held = eng_q.model.state_dict()
        names = quantized_weights(trainer.policy, fmt)
        assert names
        for name, module in names.items():
            assert torch.equal(fake_quantize(module.weight, fmt, name).detach(), held[name]), name
        # log-probs of one sequence: the QAT trainer matches the quantised engine, not the full one
        ids = torch.randint(0, TINY["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            ours = forward_logprobs(trainer.policy, ids, torch.ones_like(ids)).logp[0, 1:]
        quantised = torch.tensor(asyncio.run(eng_q.score_prompt(ids[0].tolist(), 0)).token)
        full = torch.tensor(asyncio.run(eng.score_prompt(ids[0].tolist(), 0)).token)
        gap_q, gap_full = (ours - quantised).abs().max(), (ours - full).abs().max()
        assert gap_q < 1e-4 < gap_full, (gap_q, gap_full)
    finally:
        asyncio.run(eng.aclose())
        asyncio.run(eng_q.aclose())
        trainer.close()


def test_quantisation_aware_training_moves_the_master_weights():
    trainer = TorchTrainer(TINY, {"weight_format": "int4"})
    try:
        policy = trainer.policy
        ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(3))
        forward_logprobs(policy, ids, torch.ones_like(ids)).logp.sum().backward()
        for name, module in quantized_weights(policy, "int4").items():
            assert module.weight.grad is not None and module.weight.grad.abs().sum() > 0, name
        assert "model.layers.0.self_attn.q_proj.weight" in dict(trainer.named_tensors())  # names unchanged
    finally:
        trainer.close()

"""Adapter-only pushes (``weights.lora=adapters``): the engines receive each adapted module's A, B and
scaling, keep the base they loaded and merge with the trainer's own function -- so they hold bit for
bit the weights a merged push gives, for a push of the adapter's size. Bad parts, a base other than
the trainer's and a lost part are refused or caught, with nothing half-applied."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_engine.config import load_recipe
from miles_engine.engines.embedded.engine import EmbeddedEngine
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.errors import ConfigError, WeightUpdateError
from miles_engine.hub import default_hub
from miles_engine.models import adapters
from miles_engine.trainer.torch_trainer import TorchTrainer
from miles_engine.weights import create_transport
from miles_engine.weights.check import CheckOptions, WeightCheckError
from miles_engine.weights.check.transport import CheckedTransport
from miles_engine.weights.protocol import WeightPushError
from tests.rollout.helpers import run
from tests.weights.check_helpers import Alter
from tests.weights.helpers import TINY_QWEN3, engine_process

pytest.importorskip("peft")
torch.set_num_threads(1)
RANK = 4
TARGETS = ["q_proj", "v_proj", "down_proj"]
LORA = {"enabled": True, "rank": RANK, "alpha": 8, "target_modules": TARGETS}
ROWS = [([1, 5, 7, 9, 11, 13, 2, 40, 41], [0, 0, 0, 1, 1, 1, 1, 1, 1]),
        ([3, 8, 21, 22, 23, 24, 2], [0, 0, 1, 1, 1, 1, 1])]
PROMPT = [1, 5, 7, 9, 11, 13, 2, 40]


def trainer(push: str) -> TorchTrainer:
    return TorchTrainer(dict(TINY_QWEN3), {"lora": {**LORA, "push": push}, "optimizer": {"lr": 2e-2},
                                           "grad_clip": None})


def engine(seed: int = 0) -> EmbeddedEngine:
    return EmbeddedEngine.from_model(dict(TINY_QWEN3), num_threads=1, max_context=128, seed=seed)


def adapter_bytes(t: TorchTrainer) -> int:
    """A and B of every adapted module (float32) and one float64 scaling each."""
    n = 0
    for name, p in t.policy.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            n += p.numel() * p.element_size()
    return n + 8 * len(adapters.group(t.named_tensors())[1])


async def greedy(e: EmbeddedEngine) -> list[int]:
    res = await e.generate(GenerateRequest(input_ids=PROMPT, sampling=SamplingParams(temperature=0.0,
                                                                                      max_new_tokens=12)))
    return list(res.output_ids)


def test_adapters_serve_the_merged_weights_bit_for_bit_for_the_adapters_bytes():
    merged_trainer, adapter_trainer = trainer("merged"), trainer("adapters")
    merged_engine, adapter_engine = engine(), engine()

    async def main():
        to_merged = create_transport("colocated", merged_engine, check=CheckOptions())
        to_adapters = create_transport("colocated", adapter_engine, check=CheckOptions())
        await to_adapters.preflight(adapter_trainer.named_tensors())
        modules = 2 * len(TARGETS)
        for version in (1, 2, 3):
            for t in (merged_trainer, adapter_trainer):
                t.sft_step(ROWS)
            merged = await to_merged.push(list(merged_trainer.named_tensors()), version)
            exported = adapter_trainer.named_tensors()
            assert isinstance(exported, adapters.AdapterExport) and len(exported) == 3 * modules
            pushed = await to_adapters.push(exported, version)
            assert pushed.bytes == adapter_bytes(adapter_trainer) < merged.bytes / 4
            assert merged.tensors_checked == modules and pushed.tensors_checked == 4 * modules  # parts + merged
            held, want = adapter_engine.served_tensors(), merged_engine.served_tensors()
            assert all(torch.equal(held[n], want[n]) for n in merged_engine.model.state_dict())
            assert adapter_engine.weight_version == version
            assert await greedy(adapter_engine) == await greedy(merged_engine)
        # the trainers trained alike: what the adapters give is what a merged push gives
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(sorted(dict(merged_trainer.named_tensors()).items()),
                                                              sorted(exported.effective().items())))
        await merged_engine.aclose()
        await adapter_engine.aclose()
    run(main(), 120)


def test_a_changed_adapter_part_fails_the_check_naming_the_part_and_the_weight():
    t, e = trainer("adapters"), engine()
    bad_b = "model.layers.1.mlp.down_proj.weight:lora.B"

    async def main():
        transport = CheckedTransport(Alter(create_transport("colocated", e), lambda n, x: x + 1e-3 if n == bad_b else x),
                                     e, CheckOptions())
        await transport.preflight(t.named_tensors())
        t.sft_step(ROWS)
        with pytest.raises(WeightCheckError) as err:
            await transport.push(t.named_tensors(), 1)
        assert bad_b in str(err.value) and "'model.layers.1.mlp.down_proj.weight'" in str(err.value)
        assert "self_attn" not in str(err.value)
        await e.aclose()
    run(main(), 60)


def test_an_engine_base_other_than_the_trainers_is_refused_before_the_first_push():
    t, other = trainer("adapters"), engine(seed=1)  # another random init: not the trainer's base

    async def main():
        transport = create_transport("colocated", other, check=CheckOptions())
        with pytest.raises(WeightPushError, match="holds base weights other than the trainer's: model.layers.0"):
            await transport.preflight(t.named_tensors())
        await other.aclose()
    run(main(), 60)


def test_bad_adapter_parts_are_refused_and_change_nothing():
    t, e = trainer("adapters"), engine()
    t.sft_step(ROWS)
    good = dict(t.named_tensors())
    q = "model.layers.0.self_attn.q_proj.weight"
    before = {n: x.clone() for n, x in e.served_tensors().items()}

    def refused(weights: dict, match: str) -> None:
        with pytest.raises(WeightUpdateError, match=match):
            run(e.update_weights(weights, version=7), 30)
        assert e.weight_version == 0
        assert all(torch.equal(x, before[n]) for n, x in e.served_tensors().items())

    refused({k: v for k, v in good.items() if k != f"{q}:lora.scaling"}, "scaling missing")
    refused({**good, f"{q}:lora.A": good[f"{q}:lora.A"][:, :-1]}, r"takes A of r x")
    refused({**good, f"{q}:lora.B": torch.zeros(good[f"{q}:lora.B"].shape[0], RANK + 1)}, "differ in rank")
    refused({**good, f"{q}:lora.scaling": torch.tensor([2.0])}, "not float64")
    refused({**good, q: before[q]}, "arrives both whole and as adapter parts")
    refused({"model.layers.0.self_attn.qq_proj.weight:lora.A": good[f"{q}:lora.A"]}, "unknown tensor")
    run(e.aclose(), 30)


def test_a_fresh_engine_keeps_its_base_at_the_first_adapter_push_and_a_rewritten_one_refuses():
    t = trainer("adapters")
    t.sft_step(ROWS)
    parts = dict(t.named_tensors())
    fresh, rewritten = engine(), engine()
    q = "model.layers.0.self_attn.q_proj.weight"

    async def main():
        assert await fresh.update_weights(parts, version=1) == 1  # a restarted engine: never written, base kept now
        merged = t.named_tensors().effective()
        assert torch.equal(fresh.served_tensors()[q], merged[q])
        await rewritten.update_weights({q: torch.zeros_like(rewritten.served_tensors()[q])}, version=1)
        with pytest.raises(WeightUpdateError, match="overwritten by a whole tensor before its base was kept"):
            await rewritten.update_weights(parts, version=2)
        assert rewritten.weight_version == 1
        await fresh.aclose()
        await rewritten.aclose()
    run(main(), 60)


@pytest.mark.timeout(180)
def test_adapters_over_broadcast_to_an_engine_process(tmp_path):
    from miles_engine.engines.http.client import HttpEngine
    from miles_engine.weights.tensors import digests

    t = trainer("adapters")

    async def main(url: str):
        import httpx

        async with httpx.AsyncClient(timeout=30) as http:  # bad requests: one clear refusal each
            bad = await http.post(f"{url}/miles/lora_base", json={"names": "q_proj"})
            assert bad.status_code == 400 and "a list of tensor names" in bad.json()["message"]
            bad = await http.post(f"{url}/miles/lora_base", json={"names": ["model.nope.weight"]})
            assert bad.status_code == 400 and "no tensor 'model.nope.weight'" in bad.json()["message"]
        e = await HttpEngine(url, name="engine-proc").connect()
        try:
            transport = create_transport("broadcast", e, bucket_bytes=16 << 10, backend="gloo", timeout_s=30,
                                         group_name="lora-adapters", check=CheckOptions())
            await transport.preflight(t.named_tensors())  # the server keeps its bases (POST /miles/lora_base)
            for version in (1, 2):
                t.sft_step(ROWS)
                exported = t.named_tensors()
                stats = await transport.push(exported, version)
                assert stats.bytes == adapter_bytes(t) and stats.tensors_checked == 4 * 2 * len(TARGETS)
                sums = await e.weight_checksums()
                assert all(sums[n] == d for n, d in digests(exported.effective()).items())
            await transport.close()
        finally:
            await e.aclose()
    with engine_process(tmp_path) as proc:
        run(main(proc.url), 150)


RECIPE = """\
environment: {name: shell-drills, options: {num_tasks: 5}}
trainer: {lora: {enabled: true}}
"""


def _recipe(tmp_path: Path, *overrides: str):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    return load_recipe(path, list(overrides), hub=default_hub())


def test_weights_lora_auto_picks_adapters_only_where_every_engine_merges_them(tmp_path):
    assert _recipe(tmp_path).trainer.lora.push == "adapters"
    assert _recipe(tmp_path, "weights.lora=merged").trainer.lora.push == "merged"
    for why in (["engines.0.kind=server", "weights.transport=disk_delta"], ["precision.rollout=fp8"],
                ["engines.0.dtype=bfloat16"]):
        assert _recipe(tmp_path, *why).trainer.lora.push == "merged", why
    assert _recipe(tmp_path, "engines.0.kind=server", "weights.transport=broadcast").trainer.lora.push == "adapters"
    cfg = _recipe(tmp_path, "weights.lora=adapters")
    assert "push" not in cfg.model_dump()["trainer"]["lora"]  # derived: a run's config.yaml says weights.lora


@pytest.mark.parametrize(("overrides", "why"), [
    (["precision.rollout=fp8"], "precision.rollout='fp8'"),
    (["engines.0.kind=server", "weights.transport=disk_delta"], "weights.transport='disk_delta'"),
    (["trainer.lora.enabled=false"], "needs trainer.lora.enabled=true"),
])
def test_weights_lora_adapters_where_they_cannot_go_is_one_error(tmp_path, overrides, why):
    with pytest.raises(ConfigError) as err:
        _recipe(tmp_path, "weights.lora=adapters", *overrides)
    assert why in str(err.value) and "weights.lora" in str(err.value)
    with pytest.raises(ConfigError, match="derived from weights.lora"):
        _recipe(tmp_path, "trainer.lora.push=adapters")

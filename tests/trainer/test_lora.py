"""LoRA (``trainer.lora``): adapters only train; engines receive the merged weights of the adapted
modules - and nothing else - over every transport, verified by check-weight-update-equal; the
engine then computes what the adapted trainer computes."""

from __future__ import annotations


import pytest
import torch

from miles_engine.engines.embedded.engine import EmbeddedEngine
from miles_engine.trainer.torch_trainer import TorchTrainer
from miles_engine.weights import create_transport
from miles_engine.weights.check import CheckOptions, WeightCheckError
from miles_engine.weights.check.transport import CheckedTransport
from tests.rollout.helpers import run
from tests.weights.check_helpers import SkipOne
from tests.weights.helpers import TINY_QWEN3, engine_process

torch.set_num_threads(1)
LORA = {"enabled": True, "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
ROWS = [([1, 5, 7, 9, 11, 13, 2, 40, 41], [0, 0, 0, 1, 1, 1, 1, 1, 1]),
        ([3, 8, 21, 22, 23, 24, 2], [0, 0, 1, 1, 1, 1, 1])]


def lora_trainer(**extra) -> TorchTrainer:
    return TorchTrainer(dict(TINY_QWEN3), {"lora": {**LORA, **extra}, "optimizer": {"lr": 2e-2}, "grad_clip": None})


def _engine() -> EmbeddedEngine:
    return EmbeddedEngine.from_model(dict(TINY_QWEN3), num_threads=1, max_context=128)


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_only_adapters_train_and_the_update_is_the_adapted_modules():
    trainer = lora_trainer()
    base = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if not p.requires_grad}
    trainable = {n for n, p in trainer.policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert {id(p) for p in trainer.trainable()} == {id(p) for p in trainer.policy.parameters() if p.requires_grad}
    before = dict(trainer.named_tensors())
    # 2 layers x 3 target modules, under their Hugging Face names, and equal to the base at init (B = 0)
    assert sorted(before) == sorted(f"model.layers.{i}.{m}.weight" for i in range(2)
                                    for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"))
    for name, t in before.items():
        assert torch.equal(t, base[name.replace(".weight", ".base_layer.weight")])
    for _ in range(3):
        trainer.sft_step(ROWS)
    after = dict(trainer.named_tensors())
    assert all(not torch.equal(after[n], before[n]) for n in after)
    assert all(torch.equal(p, base[n]) for n, p in trainer.policy.named_parameters() if n in base)
    state = trainer.state_dict()  # adapters (+ optimizer) only
    assert state["model"] and all(".lora_" in k for k in state["model"])


@pytest.mark.parametrize("transport", ["colocated", "disk_delta"])
def test_lora_push_is_checked_equal_and_the_engine_computes_the_adapted_policy(tmp_path, transport):
    trainer, engine = lora_trainer(), _engine()
    ids = [1, 5, 7, 9, 11, 13, 2, 40]
    assert torch.equal(_logits(engine.model, ids), _logits(trainer.policy, ids))  # one source, same init

    async def main():
        opts = {"root": str(tmp_path)} if transport == "disk_delta" else {}
        t = create_transport(transport, engine, check=CheckOptions(), **opts)
        if hasattr(t, "preflight"):
            await t.preflight(list(trainer.named_tensors()))
        n = len(dict(trainer.named_tensors()))
        for version in (1, 2):
            trainer.sft_step(ROWS)
            stats = await t.push(list(trainer.named_tensors()), version=version)
            assert stats.tensors_checked == n and engine.weight_version == version
            gap = (_logits(engine.model, ids) - _logits(trainer.policy, ids)).abs().max().item()
            assert 0 < n and gap < 1e-4  # merged W + s*B@A in the engine == base(x) + s*B(A(x)) in the trainer
        # the check catches a LoRA update that loses a tensor
        broken = CheckedTransport(SkipOne(create_transport(transport, engine, **opts) if transport == "colocated"
                                          else t, "model.layers.1.mlp.down_proj.weight"), engine, CheckOptions())
        trainer.sft_step(ROWS)
        with pytest.raises(WeightCheckError, match="down_proj"):
            await broken.push(list(trainer.named_tensors()), version=3)
        await t.close()
        await engine.aclose()
    run(main(), 120)


@pytest.mark.timeout(180)
def test_lora_push_over_broadcast_to_an_engine_process(tmp_path):
    from miles_engine.engines.http.client import HttpEngine
    from miles_engine.weights.tensors import digests

    trainer = lora_trainer()

    async def main(url: str):
        engine = await HttpEngine(url, name="engine-proc").connect()
        try:
            t = create_transport("broadcast", engine, bucket_bytes=16 << 10, backend="gloo", timeout_s=30,
                                 group_name="lora", check=CheckOptions())
            trainer.sft_step(ROWS)
            pushed = list(trainer.named_tensors())
            stats = await t.push(pushed, version=1)
            assert stats.tensors_checked == len(pushed) == 6
            sums = await engine.weight_checksums()
            mine = digests(dict(pushed))
            assert all(sums[n] == d for n, d in mine.items())
            await t.close()
        finally:
            await engine.aclose()
    with engine_process(tmp_path) as proc:
        run(main(proc.url), 150)


def test_lora_sft_dropout_only_in_sft_steps():
    trainer = lora_trainer(dropout=0.5)
    drops = [m for n, m in trainer.policy.named_modules() if n.endswith("lora_dropout.default")]
    assert drops and not any(m.training for m in drops)
    trainer.sft_step(ROWS)
    assert not any(m.training for m in drops)  # back in eval mode for RL and log-prob passes
    a = trainer.compute_logprobs([ROWS[0]])
    assert a == trainer.compute_logprobs([ROWS[0]])


def test_bad_target_modules_are_named():
    with pytest.raises(ValueError, match="trainer.lora.target_modules"):
        lora_trainer(target_modules=["no_such_proj"])

"""trainer.backend=megatron against the torch backend: same weights, same batch -> same loss
and gradients (mapped back to HF names) for GRPO and SFT at TP=1, TP=2 and PP=2 (with
micro-batches); the mapping on real GPTModels (bit-exact round trip, same logits as HF); R3 in
Megatron's routers; checkpoints that move between the backends; weights pushed to an engine
with check_update_equal. Each test starts one set of rank processes (~10 s of megatron import)."""

from __future__ import annotations

import copy
import operator

import pytest
import torch

pytest.importorskip("megatron.core")

from miles_engine.trainer.factory import create_trainer  # noqa: E402
from miles_engine.trainer.megatron import checks  # noqa: E402
from miles_engine.trainer.torch_trainer import TorchTrainer  # noqa: E402
from tests.trainer.helpers import MOE, TINY, random_groups  # noqa: E402

torch.set_num_threads(1)
TOL = 1e-5
SFT_ROWS = [([1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 1, 1, 1, 1]), ([9, 8, 7, 6, 5], [0, 0, 1, 1, 1]),
            ([3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [0] * 4 + [1] * 6)]
BASE = {"optimizer": {"lr": 1e-2}, "max_tokens_per_micro_batch": 48}  # several micro-batches per step


class GradTorchTrainer(TorchTrainer):
    """The torch backend, keeping each step's gradient (before clipping) for comparison."""

    def optimizer_step(self, opt, sched, params):
        self.captured = {n: p.grad.detach().clone() for n, p in self.policy.named_parameters()}
        return super().optimizer_step(opt, sched, params)


def _megatron(model, cfg: dict, world: int, **sizes):
    trainer = create_trainer(model, {**cfg, "backend": "megatron", "megatron": sizes}, world_size=world)
    trainer.call(setattr, "capture_grads", True)
    return trainer


def _same_step(ref: GradTorchTrainer, mg, a: dict, b: dict, keys: tuple[str, ...]) -> None:
    for k in keys:
        assert b[k] == pytest.approx(a[k], abs=TOL), k
    grads = mg.call(operator.attrgetter("captured_grads"))
    worst = max((grads[n] - g).abs().max().item() for n, g in ref.captured.items())
    assert worst < TOL, worst


def _push_checked(named: dict[str, torch.Tensor], model) -> None:
    """The gathered HF tensors through the colocated transport into an engine, every tensor
    verified by check_update_equal."""
    from miles_engine.engines.embedded.engine import EmbeddedEngine
    from miles_engine.weights import create_transport
    from miles_engine.weights.check import CheckOptions
    from tests.rollout.helpers import run

    engine = EmbeddedEngine.from_model(dict(model), num_threads=1, max_context=128)

    async def main():
        transport = create_transport("colocated", engine, check=CheckOptions())
        stats = await transport.push(iter(named.items()), version=2)
        assert stats.tensors_checked == len(named) > 0  # tied: both names, as the torch backend pushes them
        live = engine.model.state_dict()
        assert all(torch.equal(live[k], v) for k, v in named.items())
        await transport.close()
        await engine.aclose()
    run(main(), 60)


def _parity(model, world: int, cfg: dict | None = None, groups=None, push: bool = False, checks_on=None,
            **sizes) -> None:
    cfg = {**BASE, **(cfg or {})}
    ref = GradTorchTrainer(copy.deepcopy(model), cfg)
    with _megatron(model, cfg, world, **sizes) as mg:
        if checks_on is not None:
            checks_on(mg)
        _same_step(ref, mg, ref.sft_step(SFT_ROWS), mg.sft_step(SFT_ROWS), ("loss", "nll", "grad_norm", "tokens"))
        groups = groups or random_groups(3, 3, seed=1)
        keys = ("loss", "pg_loss", "entropy", "grad_norm", "reward_mean", "tokens", "ratio_mean")
        _same_step(ref, mg, ref.train_step(groups), mg.train_step(groups), keys)
        ours, theirs = dict(mg.named_tensors()), dict(ref.named_tensors())
        assert list(ours) == list(theirs)
        assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-3  # two Adam steps apart
        if push:
            _push_checked(ours, model)


def test_tp1_mapping_r3_grpo_sft_and_checkpoints_across_backends(tmp_path) -> None:
    moe = dict(MOE, tie_word_embeddings=False)
    cfg = {**BASE, "algorithm": {"routing_replay": True}}
    ref = GradTorchTrainer(dict(moe), cfg)
    with _megatron(moe, cfg, 1) as mg:
        # the mapping on real GPTModels: HF -> Megatron -> HF bit exact, logits as HF's (fp32)
        ids = [[1, 5, 9, 200, 3, 7, 11, 2], [4, 4, 8, 15, 16, 23, 42, 0]]
        for source in ("tiny:qwen3", "tiny:llama", "tiny:qwen3_moe", dict(TINY)):
            got = mg.call(checks.round_trip, source, ids)
            assert got["names"] and got["mismatched"] == [], source
            assert got["logits_max_diff"] < TOL, (source, got["logits_max_diff"])
        # R3: the replayed forward routes exactly the recorded experts, -1 rows keep the router's
        routes = torch.randint(0, 4, (2, 8, 2, 1)).expand(-1, -1, -1, 2).clone()
        routes[..., 1] = (routes[..., 0] + 1) % 4
        routes[:, :2] = -1
        out = mg.call(checks.replayed_forward, ids, routes)
        free = mg.call(checks.replayed_forward, ids, torch.full_like(routes, -1))
        for layer in range(2):
            used = out["experts"][layer]
            assert torch.equal(used[:, 2:].sort(-1).values, routes[:, 2:, layer].sort(-1).values)
            assert torch.equal(used[:, :2], free["experts"][layer][:, :2])
        assert not torch.allclose(out["logits"], free["logits"])
        # GRPO with replayed routes and SFT: the torch backend's loss and gradients
        groups = random_groups(3, 3, seed=2, routed=True)
        _same_step(ref, mg, ref.sft_step(SFT_ROWS), mg.sft_step(SFT_ROWS), ("loss", "nll", "grad_norm"))
        a, b = ref.train_step(groups), mg.train_step(groups)
        _same_step(ref, mg, a, b, ("loss", "pg_loss", "grad_norm", "r3/replayed_fraction"))
        assert b["r3/replayed_fraction"] > 0.5
        # checkpoints: the torch backend's state resumes on Megatron and back, step for step
        mg.load_state_dict(ref.state_dict())
        assert mg.weight_version == ref.weight_version == 2
        groups = random_groups(3, 3, seed=3, routed=True)
        _same_step(ref, mg, ref.train_step(groups), mg.train_step(groups), ("loss", "grad_norm"))
        state = mg.state_dict()
        assert state["optimizer"]["state"].keys() == ref.state_dict()["optimizer"]["state"].keys()
        back = GradTorchTrainer(dict(moe), cfg)
        back.load_state_dict(state)
        resumed, expected = back.state_dict()["optimizer"]["state"], ref.state_dict()["optimizer"]["state"]
        for k, v in expected.items():
            assert resumed[k]["step"] == v["step"]
            for m in ("exp_avg", "exp_avg_sq"):
                assert torch.allclose(resumed[k][m], v[m], atol=1e-6), (k, m)
        # conversion: the checkpoint's policy as an HF model directory
        from miles_engine.models.loading import load_model
        from miles_engine.trainer.megatron.convert import policy_tensors, to_hf_dir

        loaded, _ = load_model(str(to_hf_dir(policy_tensors(state), dict(moe), tmp_path / "hf")))
        named = dict(mg.named_tensors())
        assert all(torch.equal(v, named[k]) for k, v in loaded.state_dict().items())
        sft_again = ([5, 6, 7, 8, 9], [0, 1, 1, 1, 1])
        assert back.sft_step([sft_again])["loss"] == pytest.approx(mg.sft_step([sft_again])["loss"], abs=TOL)


def test_tp2_equals_the_torch_backend_grpo_sft_and_pushes_checked_weights() -> None:
    _parity(dict(TINY), 2, push=True, tensor_parallel=2)  # tied embeddings, vocab split over TP


@pytest.mark.slow
def test_pp2_with_micro_batches_equals_the_torch_backend() -> None:
    _parity(dict(TINY), 2, pipeline_parallel=2)  # tied embeddings across the two stages


@pytest.mark.slow
def test_dp2_equals_the_torch_backend() -> None:
    _parity(dict(TINY, tie_word_embeddings=False), 2)  # TP=1 x 2 data-parallel ranks: rows split, grads averaged


def _ep_checks(mg) -> None:
    """Experts sharded over the EP ranks: the mapping round trips bit exact with HF's logits, and the
    replayed forward (every rank in step) routes exactly the recorded experts."""
    ids = [[1, 5, 9, 200, 3, 7, 11, 2], [4, 4, 8, 15, 16, 23, 42, 0]]
    got = mg.call(checks.round_trip, dict(MOE, tie_word_embeddings=False), ids)
    assert got["names"] and got["mismatched"] == [] and got["logits_max_diff"] < TOL, got
    routes = torch.randint(0, 4, (2, 8, 2, 1), generator=torch.Generator().manual_seed(0)).expand(-1, -1, -1, 2).clone()
    routes[..., 1] = (routes[..., 0] + 1) % 4
    used = mg.call(checks.replayed_forward, ids, routes)["experts"]
    assert all(torch.equal(used[i].sort(-1).values, routes[:, :, i].sort(-1).values) for i in range(2))


def test_ep2_equals_the_torch_backend_with_r3_and_pushes_checked_weights() -> None:
    """EP=2 over two data-parallel ranks (2 experts each): uneven rows and micro-batch counts per rank
    (padded token dispatch, dummy micro-batches), routes replayed, expert shards gathered for the push."""
    _parity(dict(MOE, tie_word_embeddings=False), 2, {"algorithm": {"routing_replay": True}},
            groups=random_groups(3, 3, seed=2, routed=True), push=True, checks_on=_ep_checks, expert_parallel=2)


@pytest.mark.slow
def test_tp2_sequence_parallel_equals_the_torch_backend_moe_with_r3() -> None:
    """SP: each TP rank holds half of each (padded) sequence between the blocks; norms and router see
    half of the tokens (their grads summed over TP), each rank replays the routes of its half."""
    _parity(dict(MOE), 2, {"algorithm": {"routing_replay": True}}, groups=random_groups(3, 3, seed=2, routed=True),
            tensor_parallel=2, sequence_parallel=True)


@pytest.mark.parametrize("fmt,exceptions,tp", [("fp8", [], 1), ("fp8", [], 2), ("nvfp4", ["model.layers.1.mlp.*"], 2)])
def test_quantisation_aware_training_equals_the_torch_backend(fmt, exceptions, tp) -> None:
    """precision.train on Megatron: its fused linear_qkv / linear_fc1 are split back into the Hugging
    Face weights, each fake-quantised under its own name (FP8's 128x128 tiles, NVFP4's per-tensor
    scale belong to each weight; the exceptions read those names) and fused again: the same step as
    the torch backend's QAT, which computes visibly otherwise than full precision. At TP 2 every
    tile of TINY's weights straddles the two ranks' shards and NVFP4's scale is the whole weight's:
    each rank quantises the gathered weight, so the step is still the one-process step."""
    cfg = {"weight_format": fmt, "weight_exceptions": exceptions}
    full = TorchTrainer(dict(TINY), BASE).sft_step(SFT_ROWS)["loss"]
    quantised = TorchTrainer(dict(TINY), {**BASE, **cfg}).sft_step(SFT_ROWS)["loss"]
    assert abs(full - quantised) > 100 * TOL, (full, quantised)
    _parity(dict(TINY), tp, cfg, tensor_parallel=tp)


@pytest.mark.parametrize("sizes", [{"tensor_parallel": 2, "sequence_parallel": True}, {"expert_parallel": 2}])
def test_quantisation_aware_training_of_a_moe_equals_the_torch_backend(sizes) -> None:
    """On a MoE model the contract quantises the attention layers and every routed expert (each
    expert of the stacked gate_up_proj / down_proj a weight of its own), not the router; Megatron
    (TP 2 with sequence parallel and expert tensor parallel; EP 2) takes the same set and the same
    step, R3 keeping the routing identical."""
    from miles_engine.precision.targets import quantized_weights
    from miles_engine.trainer.models import build_causal_lm

    chosen = quantized_weights(build_causal_lm(dict(MOE), torch.device("cpu"), 0), "fp8")
    assert "model.layers.0.mlp.experts.gate_up_proj" in chosen and "model.layers.0.mlp.gate.weight" not in chosen
    cfg = {"weight_format": "fp8", "algorithm": {"routing_replay": True}}
    full = TorchTrainer(dict(MOE), BASE).sft_step(SFT_ROWS)["loss"]
    assert abs(full - TorchTrainer(dict(MOE), {**BASE, **cfg}).sft_step(SFT_ROWS)["loss"]) > 100 * TOL
    _parity(dict(MOE), 2, cfg, groups=random_groups(3, 3, seed=2, routed=True), **sizes)

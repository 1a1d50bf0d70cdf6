"""True on-policy: the trainer's log-probs equal (``==``) the embedded engine's, dense and MoE.

Engine side: batches of 1, 7 and 64 concurrent requests of mixed prompt and output lengths
(continuous batching: rows join and leave between decode steps), GRPO groups whose attempts
hit the shared-prompt cache, and the same with the cache off. Trainer side: the real
old-log-prob pass (``train_step`` with the separate no-grad pass and fused into the update),
shared prefixes on and off, micro-batches of 1 row and of 8, and ``compute_logprobs``; then
after a weight push. MoE: with R3 replay the trainer's routed experts are the engine's.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from miles_engine.engines.embedded.engine import EmbeddedEngine
from miles_engine.models.loading import load_model
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.errors import ConfigError
from miles_engine.rollout.types import Group, Trajectory
from miles_engine.trainer import TorchTrainer
from miles_engine.trainer.batch import from_sft_rows
from miles_engine.trainer.rows import as_sft_rows

from ..trainer.helpers import MOE, TINY

torch.set_num_threads(1)


def _requests(n_rows: int, group: int, seed: int) -> list[tuple[int, list[int], int]]:
    """(group index, prompt, max_new_tokens) for ``n_rows`` requests in groups of ``group``
    sharing a prompt (18..40 tokens, so trainer.shared_prefix has prompts worth sharing)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range((n_rows + group - 1) // group):
        prompt = torch.randint(0, 256, (int(torch.randint(18, 41, (1,), generator=g)),), generator=g).tolist()
        for _ in range(min(group, n_rows - i * group)):
            out.append((i, prompt, int(torch.randint(1, 9, (1,), generator=g))))
    return out


async def _rollout(engine: EmbeddedEngine, reqs: list[tuple[int, list[int], int]], seed: int,
                   routed: bool = False) -> list[Group]:
    results = await asyncio.gather(*[engine.generate(GenerateRequest(
        input_ids=p, return_routed_experts=routed,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=n, seed=seed * 1000 + k)))
        for k, (_, p, n) in enumerate(reqs)])
    groups: dict[int, list[Trajectory]] = {}
    for (i, p, _), r in zip(reqs, results):
        trajs = groups.setdefault(i, [])
        n = len(p)
        trajs.append(Trajectory(p + r.output_ids, [0] * n + [1] * len(r.output_ids), [0.0] * n + r.output_logprobs,
                                [None] * n + r.weight_versions, reward=float(len(trajs) % 2), index=len(trajs),
                                routed_experts=([None] * n + r.routed_experts) if routed else None))
    return [Group(f"s{seed}g{i}", f"t{i}", ts, engine.weight_version) for i, ts in groups.items()]


def _trainer(base, **cfg) -> TorchTrainer:
    algorithm = {"grpo_std_normalization": False, **cfg.pop("algorithm", {})}
    return TorchTrainer(copy.deepcopy(base), {"true_on_policy": True, "optimizer": {"lr": 1e-2},
                                              "mismatch": {"mode": "tis"}, "algorithm": algorithm, **cfg})


def _micro_batch_rows(tr: TorchTrainer, groups: list[Group]) -> list[int]:
    """Rows per micro-batch of the trainer's log-prob pass over ``groups`` (as compute_logprobs plans it)."""
    rows = [(t.token_ids, t.loss_mask) for g in groups for t in g.trajectories]
    sb = from_sft_rows(as_sft_rows(rows), tr.pad_id)
    return [len(mb) for mb in tr.plan(sb, range(sb.rows))]


def _exact(tr: TorchTrainer, groups: list[Group]) -> None:
    trajs = [t for g in groups for t in g.trajectories]
    got = tr.compute_logprobs([(t.token_ids, t.loss_mask) for t in trajs])
    for t, lp in zip(trajs, got):
        assert [a for a, m in zip(t.rollout_logprobs, t.loss_mask) if m] == [b for b, m in zip(lp, t.loss_mask) if m]


def _numerics_exact(m: dict[str, float], tokens: int) -> None:
    assert m["tis/numerics_tokens"] == tokens and m["tis/stale_tokens"] == 0
    assert m["tis/numerics_max_abs_diff"] == 0.0 and m["tis/numerics_abs_diff"] == 0.0
    assert m["tis/ratio_min"] == m["tis/ratio_max"] == 1.0


@pytest.mark.parametrize("model", [TINY, MOE], ids=["dense", "moe"])
def test_trainer_logprobs_equal_engine_logprobs_at_every_batch_shape(model: dict) -> None:
    base, _ = load_model(model)
    cached = EmbeddedEngine.from_model(base, true_on_policy=True, max_context=128)
    uncached = EmbeddedEngine.from_model(base, true_on_policy=True, max_context=128, prompt_cache_tokens=0)
    shapes = [(1, 1), (7, 3), (64, 8)]

    async def main() -> list[list[Group]]:
        try:
            out = [await _rollout(cached, _requests(n, g, seed=n), seed=n) for n, g in shapes]
            out.append(await _rollout(cached, _requests(64, 8, seed=64), seed=65))  # prompts now in the cache
            out.append(await _rollout(uncached, _requests(64, 8, seed=64), seed=64))
            assert cached.stats()["prompt_hits"] > 0 and uncached.stats()["prompt_hits"] == 0
            return out
        finally:
            await cached.aclose()
            await uncached.aclose()

    rollouts = asyncio.run(asyncio.wait_for(main(), 300))
    configs = [dict(shared_prefix=True, max_tokens_per_micro_batch=1),  # one row per micro-batch
               dict(shared_prefix=False, max_tokens_per_micro_batch=8 * 48),  # eight rows per micro-batch
               dict(shared_prefix=True, max_tokens_per_micro_batch=8 * 48, algorithm={"fuse_old_logprobs": False})]
    for cfg in configs:
        for groups in rollouts:
            tr = _trainer(base, **cfg)
            sizes = _micro_batch_rows(tr, groups)
            n_rows = sum(sizes)
            assert set(sizes) == {1} if cfg["max_tokens_per_micro_batch"] == 1 else sizes[0] >= min(8, n_rows)
            _exact(tr, groups)
            m = tr.train_step(groups)  # the real old-log-prob pass (separate or fused), then an update
            _numerics_exact(m, sum(sum(t.loss_mask) for g in groups for t in g.trajectories))


@pytest.mark.parametrize("model", [TINY, MOE], ids=["dense", "moe"])
def test_exact_after_a_weight_push_and_r3_routes_match(model: dict) -> None:
    """Engine and trainer stay exact after the trainer's update is pushed; MoE with R3: the
    engine's recorded routes are replayed, and equal the trainer's own routing."""
    moe = model is MOE
    base, _ = load_model(model)
    tr = _trainer(base, algorithm={"routing_replay": moe})
    engine = EmbeddedEngine.from_model(base, true_on_policy=True, max_context=128)

    async def main() -> None:
        try:
            groups = await _rollout(engine, _requests(16, 4, seed=5), seed=5, routed=moe)
            m = tr.train_step(groups)
            _numerics_exact(m, sum(sum(t.loss_mask) for g in groups for t in g.trajectories))
            if moe:
                assert m["r3/replayed_fraction"] == 1.0
            version = await engine.update_weights(dict(tr.named_tensors()), version=tr.weight_version)
            assert version == tr.weight_version == 1
            fresh = await _rollout(engine, _requests(16, 4, seed=6), seed=6, routed=moe)
            _exact(tr, fresh)
            if moe:  # R3: the trainer's own routing of the sampled positions equals the engine's record
                tr.set_routing(None)
                for t in (t for g in fresh for t in g.trajectories):
                    with torch.no_grad():
                        tr.policy(input_ids=torch.tensor([t.token_ids]), use_cache=False)
                    for i, route in enumerate(t.routed_experts):
                        if route is not None:
                            own = [layer.reshape(len(t.token_ids), -1)[i - 1].tolist() for layer in tr.replay.last]
                            assert own == route
            m = tr.train_step(fresh)
            _numerics_exact(m, sum(sum(t.loss_mask) for g in fresh for t in g.trajectories))
            stale = tr.train_step(fresh)  # sampled by version 1, trained at version 2: staleness, not numerics
            assert stale["tis/numerics_tokens"] == 0 and stale["tis/stale_tokens"] > 0
            assert stale["tis/stale_abs_diff"] > 0 and "tis/numerics_abs_diff" not in stale
        finally:
            await engine.aclose()

    asyncio.run(asyncio.wait_for(main(), 300))


def test_without_the_mode_the_gap_is_numerics_and_nonzero() -> None:
    """The metric measures something: the plain fast path differs from the engine's cached decode."""
    base, _ = load_model(TINY)
    tr = TorchTrainer(copy.deepcopy(base), {"mismatch": {"mode": "tis"}, "algorithm": {"grpo_std_normalization": False}})
    engine = EmbeddedEngine.from_model(base, max_context=128)

    async def main() -> list[Group]:
        try:
            return await _rollout(engine, _requests(16, 4, seed=9), seed=9)
        finally:
            await engine.aclose()

    m = tr.train_step(asyncio.run(main()))
    assert m["tis/stale_tokens"] == 0 and 0 < m["tis/numerics_max_abs_diff"] < 1e-4


def test_true_on_policy_refuses_what_it_cannot_make_exact() -> None:
    with pytest.raises(ConfigError, match="true_on_policy=true needs dtype='float32'"):
        TorchTrainer(TINY, {"true_on_policy": True, "dtype": "bfloat16"})
    with pytest.raises(ConfigError, match="true_on_policy=true needs backend='torch' \\(got 'megatron'\\)"):
        TorchTrainer(TINY, {"true_on_policy": True, "backend": "megatron"})
    with pytest.raises(ConfigError, match="true_on_policy=true does not work with lora.enabled=true"):
        TorchTrainer(TINY, {"true_on_policy": True, "lora": {"enabled": True}})
    with pytest.raises(ConfigError, match="bfloat16|float32"):
        EmbeddedEngine.from_model(TINY, true_on_policy=True, dtype="bfloat16")
    from miles_engine.config.recipe import RecipeConfig

    with pytest.raises(ValueError, match="true_on_policy=true needs engines .* engines.0 is kind 'embedded', "
                                         "dtype 'bfloat16'"):
        RecipeConfig.model_validate({"environment": {"name": "x"}, "trainer": {"true_on_policy": True},
                                     "engines": [{"dtype": "bfloat16"}]})
    with pytest.raises(ValueError, match="engines.1 is kind 'external'"):
        RecipeConfig.model_validate({"environment": {"name": "x"}, "trainer": {"true_on_policy": True},
                                     "engines": [{}, {"kind": "external", "options": {"urls": ["http://127.0.0.1:1"]}}]})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", [TINY, MOE], ids=["dense", "moe"])
def test_exact_on_gpu(model: dict) -> None:
    """The same exactness on CUDA (run by scripts/gpu_check.sh): engine and trainer on the GPU."""
    base, _ = load_model(model)
    tr = TorchTrainer(copy.deepcopy(base), {"true_on_policy": True, "mismatch": {"mode": "tis"},
                                            "algorithm": {"grpo_std_normalization": False}}, device="cuda")
    engine = EmbeddedEngine.from_model(base, true_on_policy=True, device="cuda", max_context=128)

    async def main() -> list[Group]:
        try:
            return await _rollout(engine, _requests(64, 8, seed=3), seed=3)
        finally:
            await engine.aclose()

    groups = asyncio.run(asyncio.wait_for(main(), 300))
    _exact(tr, groups)
    _numerics_exact(tr.train_step(groups), sum(sum(t.loss_mask) for g in groups for t in g.trajectories))

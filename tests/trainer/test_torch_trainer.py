"""TorchTrainer end to end on a tiny Qwen3: learning, old log-probs vs the engine, micro-batching,
checkpoints, SFT, every estimator, batch validation."""

from __future__ import annotations

import asyncio
import io
import math

import pytest
import torch

from miles_engine.rollout.types import Group, Trajectory
from miles_engine.trainer import BatchError, TorchTrainer, TrainerBackend

from .helpers import TINY, max_diff, params, random_groups, traj


def _finite(metrics: dict[str, float]) -> bool:
    return all(math.isfinite(v) for v in metrics.values())


@torch.no_grad()
def _sample(policy, prompt: list[int], n: int, new: int,
            gen: torch.Generator) -> tuple[list[list[int]], list[list[float]]]:
    ids = torch.tensor([prompt] * n)
    lps = []
    for _ in range(new):
        logp = torch.log_softmax(policy(input_ids=ids).logits[:, -1].float(), -1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen)
        lps.append(logp.gather(1, tok))
        ids = torch.cat([ids, tok], 1)
    return ids.tolist(), torch.cat(lps, 1).tolist()


@torch.no_grad()
def _p_rewarded(policy, prompts: list[list[int]]) -> float:
    probs = [torch.softmax(policy(input_ids=torch.tensor([p])).logits[0, -1].float(), -1)[:32].sum().item()
             for p in prompts]
    return sum(probs) / len(probs)


def test_grpo_raises_the_probability_of_rewarded_sequences() -> None:
    tr = TorchTrainer(TINY, {"optimizer": {"lr": 3e-2}, "mismatch": {"mode": "tis"}})
    assert isinstance(tr, TrainerBackend)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (3,), generator=gen).tolist() for _ in range(8)]
    before = _p_rewarded(tr.policy, prompts)
    rewards = []
    for step in range(8):
        groups = []
        for i, p in enumerate(prompts):
            rows, lps = _sample(tr.policy, p, 8, 2, gen)
            trajs = [Trajectory(r, [0, 0, 0, 1, 1], [0.0] * 3 + lp, [None] * 3 + [step] * 2,
                                reward=float(r[3] < 32), index=j) for j, (r, lp) in enumerate(zip(rows, lps))]
            groups.append(Group(f"s{step}g{i}", f"p{i}", trajs, step))
        m = tr.train_step(groups)
        rewards.append(m["reward_mean"])
        assert _finite(m) and m["tis/logprob_abs_diff"] < 1e-4 and m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    after = _p_rewarded(tr.policy, prompts)
    assert before < 0.2 and after > 0.5, (before, after, rewards)  # seed 0: 0.13 -> 0.93
    assert sum(rewards[-3:]) > sum(rewards[:3]) + 0.5
    assert tr.weight_version == 8 and tr.rl_steps == 8


def test_old_logprobs_equal_engine_rollout_logprobs_and_after_a_push() -> None:
    from miles_engine.engines.embedded.engine import EmbeddedEngine
    from miles_engine.engines.protocol import GenerateRequest, SamplingParams

    tr = TorchTrainer(TINY, {"optimizer": {"lr": 1e-2}, "mismatch": {"mode": "tis", "low": 0.5, "high": 2.0}})
    eng = EmbeddedEngine.from_model(tr.policy, num_threads=1, max_context=128)  # a deep copy
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (5,), generator=gen).tolist() for _ in range(3)]

    async def rollout(seed: int) -> list[Group]:
        groups = []
        for i, p in enumerate(prompts):
            res = await asyncio.gather(*[eng.generate(GenerateRequest(
                input_ids=p, sampling=SamplingParams(temperature=1.0, max_new_tokens=6, seed=seed * 100 + i * 10 + j)))
                for j in range(4)])
            trajs = [Trajectory(p + r.output_ids, [0] * 5 + [1] * 6, [0.0] * 5 + r.output_logprobs,
                                [None] * 5 + r.weight_versions, reward=float(j % 2), index=j)
                     for j, r in enumerate(res)]
            groups.append(Group(f"g{seed}{i}", f"t{i}", trajs, eng.weight_version))
        return groups

    async def main() -> None:
        try:
            groups = await rollout(0)
            m = tr.train_step(groups)
            assert m["tis/logprob_abs_diff"] < 1e-5 and abs(m["tis/ratio_mean"] - 1) < 1e-5
            assert m["tis/clipfrac"] == 0 and m["tis/kl_k3"] < 1e-9
            assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m["clipfrac"] == 0
            # push the updated weights (HF names) and check the engine now samples from them
            version = await eng.update_weights(dict(tr.named_tensors()), version=tr.weight_version)
            assert version == tr.weight_version == 1
            for g in await rollout(1):
                recomputed = tr.compute_logprobs([(t.token_ids, t.loss_mask) for t in g.trajectories])
                for t, lp in zip(g.trajectories, recomputed):
                    assert t.weight_versions[-1] == 1
                    diffs = [abs(a - b) for a, b, k in zip(t.rollout_logprobs, lp, t.loss_mask) if k]
                    assert max(diffs) < 1e-5
        finally:
            await eng.aclose()

    asyncio.run(asyncio.wait_for(main(), 120))


def _grads_of_one_step(cfg: dict, budget: int, groups: list[Group]) -> dict[str, torch.Tensor]:
    tr = TorchTrainer(TINY, {**cfg, "max_tokens_per_micro_batch": budget, "grad_clip": None})
    grads: dict[str, torch.Tensor] = {}
    original = tr.optimizer_step

    def spy(opt, sched, ps):
        named = {id(p): n for n, p in tr.root.named_parameters()}
        grads.update({named[id(p)]: p.grad.clone() for p in ps if p.grad is not None})
        return original(opt, sched, ps)

    tr.optimizer_step = spy  # type: ignore[method-assign]
    tr.train_step(groups)
    return grads


def test_sft_steps_use_their_own_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm start has the box to itself (trainer.sft.num_threads); RL steps go back to
    trainer.num_threads, and an unchanged count is not set again every step."""
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    tr = TorchTrainer(TINY, {"num_threads": 1, "sft": {"num_threads": 2}})
    rows = [([1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 1])]
    tr.sft_step(rows)
    tr.sft_step(rows)
    assert calls == [1, 2]
    tr.train_step(random_groups(2, 2, seed=3))
    tr.train_step(random_groups(2, 2, seed=4))
    assert calls == [1, 2, 1]
    calls.clear()
    same = TorchTrainer(TINY, {"num_threads": 1})  # unset: SFT keeps the RL count
    same.sft_step(rows)
    assert calls == [1]


@pytest.mark.parametrize("cfg", [
    {"loss_aggregation": "token_mean", "mismatch": {"mode": "tis"}},
    {"loss_aggregation": "seq_mean_token_mean", "entropy_coef": 0.01, "kl": {"coef": 0.1, "reference": True}},
    {"algorithm": {"advantage_estimator": "ppo"}, "loss_aggregation": "seq_mean_token_sum"},
])
def test_micro_batching_gives_the_same_gradient(cfg: dict) -> None:
    groups = random_groups(3, 4, seed=3, gaps=True)
    whole = _grads_of_one_step(cfg, 10_000, groups)
    split = _grads_of_one_step(cfg, 40, groups)  # rows of 8..19 tokens: many micro-batches
    assert whole.keys() == split.keys() and len(whole) > 20
    assert max((whole[k] - split[k]).abs().max().item() for k in whole) < 1e-5
    assert max(g.abs().max().item() for g in whole.values()) > 1e-4  # not trivially zero


def test_checkpoint_round_trip_model_optimizer_scheduler() -> None:
    cfg = {"optimizer": {"lr": 1e-2}, "lr_schedule": {"kind": "linear", "warmup_steps": 2, "total_steps": 20},
           "sft": {"optimizer": {"lr": 5e-3}}, "kl": {"reference": True, "coef": 0.05}}
    a = TorchTrainer(TINY, cfg)
    groups = random_groups(2, 4, seed=5)
    a.sft_step([(t.token_ids, t.loss_mask) for t in groups[0].trajectories])
    a.train_step(groups)
    a.train_step(groups)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    b = TorchTrainer(TINY, {**cfg, "seed": 7})  # different init: everything must come from the state
    b.load_state_dict(state)
    assert max_diff(params(a), params(b)) == 0
    assert b.weight_version == a.weight_version == 3 and b.rl_steps == 2 and b.sft_steps == 1
    assert b.scheduler.get_last_lr() == a.scheduler.get_last_lr()
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) for k in sa)
    assert max_diff(dict(a.reference.state_dict()), dict(b.reference.state_dict())) == 0
    ma, mb = a.train_step(groups), b.train_step(groups)
    assert ma["loss"] == mb["loss"] and ma["lr"] == mb["lr"] and max_diff(params(a), params(b)) == 0


def test_kl_reference_is_the_policy_rl_starts_from() -> None:
    """After an SFT warm start in the same trainer, the KL anchors the SFT'd policy (not the weights
    before SFT): the first RL step copies it into the reference, so that step's KL is 0; later steps
    keep that reference. Without SFT the reference stays the initial copy."""
    cfg = {"optimizer": {"lr": 1e-2}, "sft": {"optimizer": {"lr": 5e-3}}, "kl": {"reference": True, "coef": 0.05}}
    groups = random_groups(2, 4, seed=5)
    rows = [(t.token_ids, t.loss_mask) for t in groups[0].trajectories]

    def reference(tr: TorchTrainer) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in tr.reference.named_parameters()}

    warm = TorchTrainer(TINY, cfg)
    initial = reference(warm)
    for _ in range(3):
        warm.sft_step(rows)
    after_sft = {k: v.detach().clone() for k, v in warm.policy.named_parameters()}
    assert max_diff(after_sft, initial) > 1e-3
    first = warm.train_step(groups)
    assert max_diff(reference(warm), after_sft) == 0 and first["kl"] == 0.0
    second = warm.train_step(groups)
    assert max_diff(reference(warm), after_sft) == 0 and second["kl"] > 0  # the policy moved on, the anchor not

    cold = TorchTrainer(TINY, cfg)
    cold.train_step(groups)
    cold.train_step(groups)
    assert max_diff(reference(cold), initial) == 0


def test_sft_trains_only_on_loss_mask_tokens() -> None:
    tr = TorchTrainer(TINY, {"optimizer": {"lr": 1e-2}})
    rows = [([1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 1]), ([7, 8, 9, 10], [0, 0, 1, 1])]
    before = tr.compute_logprobs(rows)
    nll = -sum(lp for (_, m), lps in zip(rows, before) for lp, k in zip(lps, m) if k) / 5
    m = tr.sft_step(rows)
    assert m["nll"] == pytest.approx(nll, abs=1e-5) and m["tokens"] == 5 and tr.weight_version == 1
    for _ in range(15):
        last = tr.sft_step(rows)
    assert last["nll"] < 0.5 * nll
    # a token with mask 0 is never a target: changing the last one changes neither loss nor update
    a, b = TorchTrainer(TINY, {"optimizer": {"lr": 1e-2}}), TorchTrainer(TINY, {"optimizer": {"lr": 1e-2}})
    ma = a.sft_step([([1, 2, 3, 4, 5], [0, 1, 1, 1, 0])])
    mb = b.sft_step([([1, 2, 3, 4, 77], [0, 1, 1, 1, 0])])
    assert ma["loss"] == mb["loss"] and max_diff(params(a), params(b)) == 0
    mc = TorchTrainer(TINY, {"optimizer": {"lr": 1e-2}}).sft_step([([1, 2, 3, 77, 5], [0, 1, 1, 1, 0])])
    assert mc["loss"] != ma["loss"]


@pytest.mark.parametrize("cfg", [
    {"algorithm": {"advantage_estimator": "gspo"}, "clip": {"eps_low": 3e-4, "eps_high": 4e-4}},
    {"algorithm": {"advantage_estimator": "ppo"}, "value": {"kind": "head"}, "ppo_epochs": 2, "minibatches": 2},
    {"algorithm": {"advantage_estimator": "ppo", "normalize_advantages": True},
     "value": {"kind": "separate", "critic_source": {**TINY, "hidden_size": 32, "num_hidden_layers": 1}}},
    {"algorithm": {"advantage_estimator": "reinforce_pp", "reinforce_pp_baseline": True, "gamma": 0.99},
     "kl": {"coef": 0.05, "reference": True, "placement": "reward", "estimator": "k1"}},
    {"opd": {"beta": 0.5}, "clip": {"dual_clip_c": 3.0}, "entropy_coef": 0.01, "dtype": "bfloat16"},
    {"algorithm": {"old_logprobs": "rollout", "grpo_std_normalization": False},
     "loss_aggregation": "seq_mean_token_sum"},
])
def test_every_estimator_trains(cfg: dict) -> None:
    tr = TorchTrainer(TINY, {"optimizer": {"lr": 1e-3}, **cfg})
    before = params(tr)
    groups = random_groups(3, 4, seed=1, teacher=-4.0, gaps=True)
    m = tr.train_step(groups)
    assert _finite(m) and m["tokens"] > 0 and max_diff(before, params(tr)) > 0
    steps = tr.config.ppo_epochs * min(tr.config.minibatches, len(groups))
    assert m["optimizer_steps"] == steps and tr.weight_version == steps
    if tr.config.algorithm.advantage_estimator == "ppo":
        assert "value_loss" in m and m["value_loss"] > 0
    if tr.config.kl.placement == "reward":
        assert "kl_reward" in m and "kl" in m
    if tr.config.opd.beta:  # teacher -4 vs student ~ -5.5: the OPD term lifts every advantage
        base = TorchTrainer(TINY, {"optimizer": {"lr": 1e-3}}).train_step(groups)
        assert m["advantage_mean"] > base["advantage_mean"] + 0.5


def test_bad_batches_are_refused_before_training() -> None:
    tr = TorchTrainer(TINY, {"opd": {"beta": 0.1}})
    good = random_groups(1, 2, teacher=-1.0)[0]

    def group(*trajs: Trajectory) -> list[Group]:
        return [Group("bad", "t", list(trajs), 0)]

    cases = [
        (group(traj([1, 2, 3], 1, None, teacher=-1.0), good.trajectories[0]), "reward is None"),
        (group(traj([1, 2, 3], 0, 1.0, teacher=-1.0), good.trajectories[0]), "loss_mask\\[0\\]"),
        (group(traj([1, 2, 999], 1, 1.0, teacher=-1.0), good.trajectories[0]), "outside the vocabulary"),
        (group(traj([1, 2, 3], 1, 1.0), good.trajectories[0]), "teacher_logprobs"),
        (group(traj([1, 2, 3], 1, 1.0, teacher=-1.0, logp=3.0), good.trajectories[0]), "not a log-probability"),
        (group(good.trajectories[0]), "grpo_std_normalization"),
        ([], "no groups"),
    ]
    before = params(tr)
    for groups, pattern in cases:
        with pytest.raises(BatchError, match=pattern):
            tr.train_step(groups)
    failed = traj([1, 2, 3], 1, 1.0, teacher=-1.0)
    failed.status = "failed"
    with pytest.raises(BatchError, match="status 'failed'"):
        tr.train_step(group(failed, good.trajectories[0]))
    with pytest.raises(BatchError, match="nothing to learn"):
        tr.sft_step([([1, 2, 3], [0, 0, 0])])
    assert max_diff(before, params(tr)) == 0 and tr.weight_version == 0


def test_named_tensors_use_hf_names_and_cast() -> None:
    tr = TorchTrainer(TINY)
    names = dict(tr.named_tensors())
    assert names.keys() == tr.policy.state_dict().keys() and "lm_head.weight" in names
    assert all(t.dtype == torch.bfloat16 for _, t in tr.named_tensors("bfloat16"))


def test_mask_truncated_drops_their_loss_but_keeps_their_rewards_in_the_baseline() -> None:
    """Overlong filtering: the gradient equals that of the same step with the truncated rows'
    loss masks zeroed by hand (advantages from all rewards either way); off, they train."""
    import copy

    def marked() -> list[Group]:
        groups = random_groups(3, 4, seed=5)
        for g in groups:
            g.trajectories[1].metrics["truncated"] = 1.0
        return groups

    masked = _grads_of_one_step({"mask_truncated": True}, 10_000, marked())
    by_hand = copy.deepcopy(marked())
    for g in by_hand:
        t = g.trajectories[1]
        t.loss_mask = [0] * len(t.loss_mask)
        t.rollout_logprobs = [0.0] * len(t.loss_mask)
        t.weight_versions = [None] * len(t.loss_mask)
    reference = _grads_of_one_step({}, 10_000, by_hand)
    assert max((masked[k] - reference[k]).abs().max().item() for k in masked) < 1e-6
    kept = _grads_of_one_step({}, 10_000, marked())
    assert max((masked[k] - kept[k]).abs().max().item() for k in masked) > 1e-4
    metrics = TorchTrainer(TINY, {"mask_truncated": True}).train_step(marked())
    assert metrics["truncated_fraction"] == pytest.approx(3 / 12)

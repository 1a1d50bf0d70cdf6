"""Shared-prefix forward: the same log-probs and gradients as the plain forward, prefix-aware
micro-batch planning, a whole train_step with the switch on vs off, and where it stays off."""

from __future__ import annotations

import pytest
import torch

from miles_engine.trainer import TorchTrainer, prefix
from miles_engine.trainer.batch import from_token_rows
from miles_engine.trainer.models import build_causal_lm, forward_logprobs, keep_mask
from miles_engine.trainer.rows import plan_micro_batches

from .helpers import (
    MOE,
    TINY,
    grads_of_one_step,
    max_diff,
    max_rel_diff,
    params,
    prompt_groups,
    random_groups,
)


def _rand(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist()


def _mixed_rows() -> tuple[list[list[int]], list[list[int]]]:
    """Groups with different prompts and completion lengths, rows sharing the prompt and more
    (and one duplicate row), a multi-turn row with an environment gap, a row alone, and a row
    scored from position 1 (an empty prefix)."""
    g = torch.Generator().manual_seed(0)
    rows: list[tuple[list[int], int]] = []  # (ids, prompt length)
    a = _rand(20, g)
    rows += [(a + _rand(n, g), 20) for n in (3, 9, 14)]
    b = _rand(25, g)
    tail = _rand(4, g)
    rows += [(b + tail + _rand(n, g), 25) for n in (2, 6)]  # share the prompt and 4 sampled tokens
    rows += [rows[-1], (b + _rand(5, g), 25)]  # a duplicate row
    c = _rand(18, g)
    rows += [(c + _rand(12, g), 18), (c + _rand(7, g), 18)]
    rows += [(_rand(30, g), 22), (_rand(9, g), 1)]  # alone; loss from position 1
    masks = [[0] * p + [1] * (len(ids) - p) for ids, p in rows]
    masks[7][18 + 4: 18 + 7] = [0, 0, 0]  # the multi-turn row: environment tokens inside
    return [ids for ids, _ in rows], masks


def _run(model, ids, attn, mask, mode, cands):
    model.zero_grad(set_to_none=True)
    out = forward_logprobs(model, ids, attn, mask=mask, entropy="grad", candidates=cands, prefix=mode)
    loss = (out.logp * mask).sum() + 0.1 * (out.entropy * mask).sum() + (out.cand_logp.exp() * mask[..., None]).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_shared_prefix_forward_matches_the_plain_forward(mode: str) -> None:
    model = build_causal_lm(TINY, torch.device("cpu"), 0)
    assert prefix.supports(model)
    rows, masks = _mixed_rows()
    b = from_token_rows(rows, masks)
    ids, attn, mask = b.token_ids, b.attention_mask, b.loss_mask
    cands = torch.randint(0, TINY["vocab_size"], (*ids.shape, 3), generator=torch.Generator().manual_seed(1))
    split = prefix.plan(ids, attn, keep_mask(mask), mode)
    assert split is not None
    assert split.prefix_ids.shape[0] == 5  # a, b (4 rows), c, the lone row, the empty one
    assert split.starts[:3] == [19, 19, 19] and split.starts[-1] == 0
    plain, g_plain = _run(model, ids, attn, mask, None, cands)
    shared, g_shared = _run(model, ids, attn, mask, mode, cands)
    assert (shared.logp == 0).equal(plain.logp == 0) and (plain.logp * mask != 0).sum() == mask.sum()
    assert (shared.logp - plain.logp).abs().max() < 1e-5
    assert (shared.entropy - plain.entropy).abs().max() < 1e-5
    assert (shared.cand_logp - plain.cand_logp).abs().max() < 1e-5
    assert g_plain.keys() == g_shared.keys() and len(g_plain) == len(list(model.parameters()))
    assert max_rel_diff(g_plain, g_shared) < 1e-5


def test_auto_mode_shares_only_long_prefixes_of_several_rows() -> None:
    short = prompt_groups([10, 12], 4, seed=1)  # prompts under MIN_SHARED_TOKENS
    long = prompt_groups([20], 1, seed=1) + prompt_groups([24], 1, seed=2)  # long prompts, one row each
    shared = prompt_groups([20], 3, seed=3)
    for groups, expect in ((short, False), (long, False), (shared, True)):
        rows = [t for g in groups for t in g.trajectories]
        b = from_token_rows([t.token_ids for t in rows], [t.loss_mask for t in rows])
        keep = keep_mask(b.loss_mask)
        assert (prefix.plan(b.token_ids, b.attention_mask, keep, "auto") is not None) is expect
        assert prefix.plan(b.token_ids, b.attention_mask, keep, "always") is not None


def test_prefix_aware_planning_keeps_groups_together_within_the_budget() -> None:
    p1, p2, p3 = tuple(range(40)), tuple(range(100, 130)), tuple(range(200, 205))
    keys = [p1, p2, p1, p3, p2, p1, p2]
    lengths = [60, 45, 52, 9, 50, 48, 33]
    plan = prefix.plan_micro_batches(keys, lengths, 150, "auto")
    assert plan == [[0, 2, 5], [4, 1, 6, 3]]  # p1's rows (the longest first), then p2's; p3's fits in
    for mb in plan:
        shape = prefix.Shape()
        for i in mb:
            shape.add(keys[i], lengths[i])
        use, cost = shape.choice("auto")
        assert use and cost <= 150
    assert prefix.plan_micro_batches(keys, lengths, 200, "auto") == [[0, 2, 5, 4, 1, 6], [3]]
    assert prefix.plan_micro_batches(keys, lengths, 10, "auto") == [[i] for i in (0, 2, 5, 4, 1, 6, 3)]
    # nothing shared: the plain planner's micro-batches
    alone = [tuple(range(k, k + 20)) for k in range(7)]
    assert prefix.plan_micro_batches(alone, lengths, 120, "auto") == plan_micro_batches(lengths, 120)


CFG = {"optimizer": {"lr": 1e-3, "eps": 1e-3}, "grad_clip": None, "max_tokens_per_micro_batch": 120,
       "mismatch": {"mode": "tis", "low": 0.9, "high": 1.1}, "entropy_coef": 0.01,
       "kl": {"reference": True, "coef": 0.05}}


@pytest.mark.parametrize("cfg", [CFG, {**CFG, "algorithm": {"fuse_old_logprobs": False}},
                                 {**CFG, "loss_aggregation": "seq_mean_token_mean", "kl": {}}])
def test_train_step_with_shared_prefix_matches_the_plain_step(cfg: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = prefix.shared_prefix_logits
    monkeypatch.setattr(prefix, "shared_prefix_logits", lambda *a: calls.append(1) or original(*a))
    groups = prompt_groups([20, 27, 18, 30], 5, seed=4, new=(2, 14), gaps=True)
    on, off = TorchTrainer(TINY, cfg), TorchTrainer(TINY, {**cfg, "shared_prefix": False})
    assert on.prefix_mode == "auto" and off.prefix_mode is None
    m_on, g_on = grads_of_one_step(on, groups)
    assert calls  # the shared path ran (update, and prepare unless fused)
    n = len(calls)
    m_off, g_off = grads_of_one_step(off, groups)
    assert len(calls) == n
    assert m_on.keys() == m_off.keys()
    for k in m_on.keys() - {"prepare_time", "update_time", "step_time"}:
        assert m_on[k] == pytest.approx(m_off[k], rel=1e-5, abs=1e-6), k
    assert max_rel_diff(g_off, g_on) < 1e-5 and max(g.abs().max().item() for g in g_off.values()) > 1e-4
    assert max_diff(params(on), params(off)) < 1e-6  # optimizer.eps 1e-3: Adam's first step is not sign(g)


def test_sft_step_with_shared_prefix_matches_the_plain_step() -> None:
    rows = [(t.token_ids, t.loss_mask) for g in prompt_groups([20, 24], 4, seed=5) for t in g.trajectories]
    on = TorchTrainer(TINY, {"optimizer": {"eps": 1e-3}, "max_tokens_per_micro_batch": 100})
    off = TorchTrainer(TINY, {"optimizer": {"eps": 1e-3}, "max_tokens_per_micro_batch": 100, "shared_prefix": False})
    m_on, m_off = on.sft_step(rows), off.sft_step(rows)
    assert m_on["loss"] == pytest.approx(m_off["loss"], rel=1e-6)
    assert max_diff(params(on), params(off)) < 1e-6


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_where_the_shared_prefix_forward_stays_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TorchTrainer(TINY, {"gradient_checkpointing": True}).prefix_mode is None
    assert TorchTrainer(MOE, {"algorithm": {"routing_replay": True}}).prefix_mode is None
    assert TorchTrainer(MOE).prefix_mode == "auto"  # MoE without replay: routing is per token
    sliding = build_causal_lm({**TINY, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
                              torch.device("cpu"), 0)
    assert not prefix.supports(sliding) and not prefix.supports(torch.nn.Linear(2, 2))
    calls = []
    original = prefix.shared_prefix_logits
    monkeypatch.setattr(prefix, "shared_prefix_logits", lambda *a: calls.append(1) or original(*a))
    groups = prompt_groups([20, 22], 4, seed=6)
    head = TorchTrainer(TINY, {"algorithm": {"advantage_estimator": "ppo"}})  # value head: all hidden states
    assert head.prefix_mode == "auto"
    head.train_step(groups)
    assert not calls
    critic = TorchTrainer(TINY, {"algorithm": {"advantage_estimator": "ppo"}, "value": {"kind": "separate"}})
    critic.train_step(groups)
    assert calls  # the policy shares; the critic runs whole rows
    random = TorchTrainer(TINY)  # no shared prompts: the plain forward
    calls.clear()
    random.train_step(random_groups(3, 4, seed=1))
    assert not calls

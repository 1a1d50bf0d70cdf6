"""Loss terms, aggregation modes, clipping, mismatch corrections and LR schedules by hand."""

from __future__ import annotations

import math

import pytest
import torch

from miles_engine.trainer import corrections as C
from miles_engine.trainer import losses as L
from miles_engine.trainer.config import ScheduleConfig
from miles_engine.trainer.optim import lr_factor

T = torch.tensor


def test_aggregation_modes() -> None:
    x = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    m = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # last row has no sampled token
    assert L.aggregate(x, m, "token_mean").item() == pytest.approx(7 / 3)
    assert L.aggregate(x, m, "seq_mean_token_mean").item() == pytest.approx((1.5 + 4) / 2)
    assert L.aggregate(x, m, "seq_mean_token_sum").item() == pytest.approx((3 + 4) / 2)
    # global denominators (other micro-batches / ranks)
    assert L.aggregate(x, m, "token_mean", num_tokens=7).item() == pytest.approx(1.0)
    assert L.aggregate(x, m, "seq_mean_token_sum", num_seqs=7).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="allowed"):
        L.aggregate(x, m, "sum", num_tokens=1)


def test_split_aggregation_sums_to_whole() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g)
    m = (torch.rand(6, 5, generator=g) > 0.3).float()
    for mode in L.AGGREGATIONS:
        whole = L.aggregate(x, m, mode)
        n, s = m.sum().item(), (m.sum(1) > 0).sum().item()
        parts = sum(L.aggregate(x[i:i + 2], m[i:i + 2], mode, num_tokens=n, num_seqs=s) for i in (0, 2, 4))
        assert parts.item() == pytest.approx(whole.item(), abs=1e-6)


def test_asymmetric_clip() -> None:
    ratio = T([[0.5, 0.9, 1.2, 1.5]])
    logp, old, mask = ratio.log(), torch.zeros(1, 4), torch.ones(1, 4)
    pos = L.policy_loss(logp, old, torch.ones(1, 4), mask, eps_low=0.2, eps_high=0.28)
    # A > 0: -min(r, clip(r, 0.8, 1.28))
    assert torch.allclose(pos.loss, T([[-0.5, -0.9, -1.2, -1.28]]), atol=1e-6)
    assert pos.clipped.tolist() == [[0, 0, 0, 1]]
    neg = L.policy_loss(logp, old, -torch.ones(1, 4), mask, eps_low=0.2, eps_high=0.28)
    # A < 0: max(r, clip(r)) -> 0.5 is lifted to 0.8 (clipped), 1.5 stays
    assert torch.allclose(neg.loss, T([[0.8, 0.9, 1.2, 1.5]]), atol=1e-6)
    assert neg.clipped.tolist() == [[1, 0, 0, 0]]
    assert torch.allclose(pos.ratio, ratio)


def test_dual_clip_caps_negative_advantages() -> None:
    logp = T([[math.log(5.0), math.log(5.0)]])
    out = L.policy_loss(logp, torch.zeros(1, 2), T([[-1.0, 1.0]]), torch.ones(1, 2), eps_low=0.2, dual_clip_c=3.0)
    assert torch.allclose(out.loss, T([[3.0, -1.2]]))
    assert out.dual_clipped.tolist() == [[1, 0]]


def test_gspo_uses_the_sequence_ratio() -> None:
    mask = T([[0.0, 1.0, 1.0]])
    logp = T([[-9.0, 0.1, 0.3]], requires_grad=True)
    out = L.policy_loss(logp, torch.zeros(1, 3), mask, mask, eps_low=0.3, sequence_level=True)
    r = math.exp(0.2)  # mean log-ratio over the sampled tokens
    assert torch.allclose(out.ratio, T([[r, r, r]]))
    assert torch.allclose(out.loss, T([[0.0, -r, -r]]), atol=1e-6)
    out.loss.sum().backward()
    assert logp.grad[0, 0] == 0 and torch.allclose(logp.grad[0, 1:], T([-r, -r]), atol=1e-6)
    clipped = L.policy_loss(logp, torch.zeros(1, 3), mask, mask, eps_low=0.2, sequence_level=True)
    assert torch.allclose(clipped.loss, T([[0.0, -1.2, -1.2]])) and clipped.clipped.sum() == 2


def test_policy_loss_is_zero_off_mask() -> None:
    out = L.policy_loss(T([[0.3, 0.3]]), T([[0.0, 0.0]]), T([[5.0, 5.0]]), T([[0.0, 1.0]]))
    assert out.loss[0, 0] == 0


def test_kl_estimators() -> None:
    logp, ref = T([0.0]), T([-0.5])
    assert L.kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert L.kl_penalty(logp, ref, "k2").item() == pytest.approx(0.125)
    assert L.kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    assert L.kl_penalty(ref, ref, "k3").item() == 0.0


def test_entropy_and_token_logprob_alignment() -> None:
    assert L.entropy_from_logits(torch.zeros(2, 4)).tolist() == pytest.approx([math.log(4)] * 2)
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = math.log(3.0)  # position 0 predicts token 1: p(2) = 3/6
    lp = L.token_logprobs(logits, T([[0, 2, 1]]))
    assert lp[0].tolist() == pytest.approx([0.0, math.log(0.5), math.log(0.25)])
    assert L.token_logprobs(logits, T([[0, 2, 1]]), temperature=2.0)[0, 2].item() == pytest.approx(math.log(0.25))


def test_value_loss_clipping() -> None:
    v, old, ret, m = T([[2.0, 0.1]]), T([[1.0, 0.0]]), T([[3.0, 0.0]]), torch.ones(1, 2)
    loss, clipped = L.value_loss(v, old, ret, m, clip=0.5)
    # token 0: unclipped (2-3)^2=1, clipped v=1.5 -> (1.5-3)^2=2.25 -> max 2.25 ; token 1: 0.01 both
    assert torch.allclose(loss, T([[1.125, 0.005]])) and clipped.tolist() == [[1, 0]]
    assert torch.allclose(L.value_loss(v, old, ret, m)[0], T([[0.5, 0.005]]))


RATIOS = [0.5, 1.0, 3.0, 0.01]


def _crafted() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rollout = torch.full((1, 5), -2.0)
    old = rollout.clone()
    old[0, :4] += torch.tensor(RATIOS).log()
    old[0, 4] = 50.0  # masked out: must not count
    return old, rollout, T([[1.0, 1.0, 1.0, 1.0, 0.0]])


def test_tis_and_clip_or_pop_weights() -> None:
    old, rollout, mask = _crafted()
    tis = C.mismatch_weights(old, rollout, mask, "tis", 0.1, 2.0)
    assert torch.allclose(tis, T([[0.5, 1.0, 2.0, 0.1, 1.0]]), atol=1e-6)
    pop = C.mismatch_weights(old, rollout, mask, "clip_or_pop", 0.1, 2.0)
    assert torch.allclose(pop, T([[0.5, 1.0, 0.0, 0.0, 1.0]]), atol=1e-6)
    assert torch.equal(C.mismatch_weights(old, rollout, mask, "none"), torch.ones(1, 5))
    assert not tis.requires_grad
    with pytest.raises(ValueError, match="mismatch.low"):
        C.mismatch_weights(old, rollout, mask, "tis", 3.0, 2.0)


def test_mismatch_metrics_on_crafted_ratios() -> None:
    old, rollout, mask = _crafted()
    m = C.finalize_stats(*C.mismatch_stats(old, rollout, mask, 0.1, 2.0))
    assert m["tis/ratio_mean"] == pytest.approx(sum(RATIOS) / 4, rel=1e-6)
    assert m["tis/ratio_min"] == pytest.approx(0.01, rel=1e-5) and m["tis/ratio_max"] == pytest.approx(3.0, rel=1e-5)
    assert m["tis/clipfrac"] == 0.5  # 3.0 and 0.01 lie outside [0.1, 2]
    assert m["tis/abs_ratio_minus_one"] == pytest.approx((0.5 + 0 + 2 + 0.99) / 4, rel=1e-5)
    assert m["tis/logprob_abs_diff"] == pytest.approx(sum(abs(math.log(r)) for r in RATIOS) / 4, rel=1e-5)
    assert m["tis/kl_k3"] == pytest.approx(sum(r - 1 - math.log(r) for r in RATIOS) / 4, rel=1e-5)


def test_lr_schedules() -> None:
    lin = ScheduleConfig(kind="linear", warmup_steps=2, total_steps=10)
    assert [lr_factor(s, lin) for s in (0, 1, 2, 6, 10, 20)] == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0, 0.0])
    cos = ScheduleConfig(kind="cosine", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    assert lr_factor(6, cos) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(4, cos) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_factor(10, cos) == pytest.approx(0.1)
    assert lr_factor(100, ScheduleConfig(warmup_steps=3)) == 1.0
    assert lr_factor(0, ScheduleConfig(warmup_steps=4)) == 0.25

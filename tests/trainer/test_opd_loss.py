"""OPD loss terms: hand-computed values and gradients, the forward's candidate gather, and a
trainer that distils a fixed teacher with the reverse-KL term as its only signal."""

from __future__ import annotations

import math

import pytest
import torch

from miles_engine.errors import ConfigError
from miles_engine.rollout.types import Group
from miles_engine.trainer import BatchError, TorchTrainer
from miles_engine.trainer.config import TrainerConfig
from miles_engine.trainer.models import forward_logprobs
from miles_engine.trainer.opd_loss import candidate_reverse_kl, sampled_reverse_kl

from .helpers import TINY, random_groups

L = math.log


def _one(values: list[float]) -> torch.Tensor:
    return torch.tensor([[values]], dtype=torch.float64)  # [rows=1, tokens=1, C]


def test_sampled_token_term() -> None:
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    teacher = torch.tensor([[0.0, -1.5, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    loss, value = sampled_reverse_kl(logp, teacher, mask)
    assert value.tolist() == [[0.0, 0.5, -1.0]]  # r = s - t on sampled tokens
    assert loss.tolist() == [[0.0, -0.5, 2.0]]  # sg(r) * s
    loss.sum().backward()
    assert logp.grad.tolist() == [[0.0, 0.5, -1.0]]  # gradient = r


def test_candidate_kl_value_by_hand() -> None:
    # student mass 0.2, 0.3 on C -> renormalised 0.4, 0.6; teacher 0.3, 0.1 -> 0.75, 0.25
    s, t = _one([L(0.2), L(0.3)]), _one([L(0.3), L(0.1)])
    mask = _one([1.0, 1.0])
    _, kl = candidate_reverse_kl(s, t, mask, "student")
    expected = 0.4 * L(0.4 / 0.75) + 0.6 * L(0.6 / 0.25)
    assert kl.item() == pytest.approx(expected, abs=1e-9)  # 0.4 ln(0.5333) + 0.6 ln(2.4)
    assert expected == pytest.approx(0.273838, abs=1e-6)  # -0.251444 + 0.525281


@pytest.mark.parametrize("weighting, w", [("student", (0.4, 0.6)), ("teacher", (0.75, 0.25)), ("uniform", (0.5, 0.5))])
def test_candidate_loss_and_gradient_by_hand(weighting: str, w: tuple[float, float]) -> None:
    s = _one([L(0.2), L(0.3)]).requires_grad_(True)
    t, mask = _one([L(0.3), L(0.1)]), _one([1.0, 1.0])
    loss, kl = candidate_reverse_kl(s, t, mask, weighting)
    p = (0.4, 0.6)
    r = (L(0.4 / 0.75), L(0.6 / 0.25))
    g = (w[0] * r[0], w[1] * r[1])
    assert loss.item() == pytest.approx(g[0] * L(0.4) + g[1] * L(0.6), abs=1e-9)
    loss.sum().backward()
    # d s_hat_c / d s_a = [c == a] - p_a  ->  grad_a = g_a - p_a * (g_0 + g_1)
    expected = [g[0] - p[0] * (g[0] + g[1]), g[1] - p[1] * (g[0] + g[1])]
    assert s.grad[0, 0].tolist() == pytest.approx(expected, abs=1e-9)
    assert kl.item() == pytest.approx(0.4 * r[0] + 0.6 * r[1], abs=1e-9)  # the value is always KL(p_s||p_t)


def test_student_weighting_is_the_exact_reverse_kl_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64).log_softmax(-1).requires_grad_(True)
    t = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64).log_softmax(-1)
    mask = (torch.rand(2, 3, 5, generator=gen) > 0.3).double()
    loss, kl = candidate_reverse_kl(s, t, mask, "student")
    (grad,) = torch.autograd.grad(loss.sum(), s)
    exact = torch.zeros(2, 3, dtype=torch.float64)
    for i in range(2):
        for j in range(3):
            m = mask[i, j] > 0
            if m.any():
                ps, pt = s[i, j][m].log_softmax(-1), t[i, j][m].log_softmax(-1)
                exact[i, j] = (ps.exp() * (ps - pt)).sum()
    (grad_exact,) = torch.autograd.grad(exact.sum(), s)
    assert torch.allclose(kl, exact.detach(), atol=1e-12)
    assert torch.allclose(grad, grad_exact, atol=1e-12)


def test_empty_candidate_set_adds_nothing() -> None:
    s = _one([-1.0, -2.0]).requires_grad_(True)
    loss, kl = candidate_reverse_kl(s, _one([-1.0, -1.0]), _one([0.0, 0.0]), "teacher")
    loss.sum().backward()
    assert loss.item() == 0.0 and kl.item() == 0.0 and s.grad.abs().sum().item() == 0.0


def test_identical_distributions_have_zero_kl_and_gradient() -> None:
    s = _one([L(0.1), L(0.2), L(0.05)]).requires_grad_(True)
    loss, kl = candidate_reverse_kl(s, _one([L(0.2), L(0.4), L(0.1)]), _one([1, 1, 1]), "uniform")
    loss.sum().backward()
    assert kl.item() == pytest.approx(0.0, abs=1e-12) and s.grad.abs().max().item() < 1e-12


def test_bad_weighting_and_config_are_refused() -> None:
    with pytest.raises(ValueError, match="allowed: student, teacher, uniform"):
        candidate_reverse_kl(_one([0.0]), _one([0.0]), _one([1.0]), "forward")
    with pytest.raises(ConfigError, match="opd.weighting='teacher' needs a candidate set"):
        TrainerConfig.load({"opd": {"coef": 1.0, "weighting": "teacher"}})
    with pytest.raises(ConfigError, match="leaves no training signal"):
        TrainerConfig.load({"opd": {"task_reward": False}})


def test_forward_gathers_candidate_logprobs() -> None:
    from miles_engine.models.loading import load_model

    model, _ = load_model(TINY)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    cands = torch.randint(0, 256, (2, 7, 3), generator=torch.Generator().manual_seed(4))
    mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1], [0, 1, 1, 1, 1, 0, 0]], dtype=torch.float32)
    full = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    want = torch.zeros(2, 7, 3)
    want[:, 1:] = full[:, :-1].gather(-1, cands[:, 1:])
    attn = torch.ones_like(ids)
    with torch.no_grad():
        dense = forward_logprobs(model, ids, attn, candidates=cands).cand_logp
        sparse = forward_logprobs(model, ids, attn, candidates=cands, mask=mask).cand_logp
    assert torch.allclose(dense, want, atol=1e-5)
    assert torch.allclose(sparse, want * mask[..., None], atol=1e-5)


def _teacher_scored(groups: list[Group], teacher, k: int) -> list[Group]:
    """Attach a fixed teacher's top-k candidates and sampled-token log-probs to every row."""
    with torch.no_grad():
        for g in groups:
            for t in g.trajectories:
                logp = torch.log_softmax(teacher(input_ids=torch.tensor([t.token_ids])).logits[0].float(), -1)
                t.teacher_logprobs = [0.0] * len(t.token_ids)
                t.teacher_candidate_ids = [[] for _ in t.token_ids]
                t.teacher_candidate_logprobs = [[] for _ in t.token_ids]
                for p, m in enumerate(t.loss_mask):
                    if m:
                        t.teacher_logprobs[p] = logp[p - 1, t.token_ids[p]].item()
                        top = torch.topk(logp[p - 1], k)
                        t.teacher_candidate_ids[p] = top.indices.tolist()
                        t.teacher_candidate_logprobs[p] = top.values.tolist()
    return groups


def _trainer(candidates: str, weighting: str = "student") -> TorchTrainer:
    return TorchTrainer(TINY, {"optimizer": {"lr": 3e-3}, "grad_clip": None,
                               "opd": {"coef": 1.0, "candidates": candidates, "weighting": weighting, "top_k": 6,
                                       "task_reward": False}})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("weighting", ["student", "uniform"])
def test_trainer_distils_with_reverse_kl_only(weighting: str) -> None:
    from miles_engine.models.loading import load_model

    teacher, _ = load_model({**TINY, "hidden_size": 96}, seed=7)
    groups = _teacher_scored(random_groups(2, 3, seed=5, teacher=-1.0), teacher, k=6)
    tr = _trainer("teacher_topk", weighting)
    kls = [tr.train_step(groups)["opd/reverse_kl"] for _ in range(12)]
    assert kls[-1] < 0.7 * kls[0], kls


@pytest.mark.timeout(120)
def test_sampled_token_term_closes_the_log_ratio_on_fixed_rows() -> None:
    """Off-policy (fixed rows) the k1 mean is not a KL; each token's |log-ratio| must still shrink."""
    from miles_engine.models.loading import load_model

    teacher, _ = load_model({**TINY, "hidden_size": 96}, seed=7)
    groups = _teacher_scored(random_groups(2, 3, seed=5, teacher=-1.0), teacher, k=6)
    tr = _trainer("sampled")

    def gap() -> float:
        total, count = 0.0, 0
        with torch.no_grad():
            for t in (t for g in groups for t in g.trajectories):
                logp = torch.log_softmax(tr.policy(input_ids=torch.tensor([t.token_ids])).logits[0].float(), -1)
                for p, m in enumerate(t.loss_mask):
                    if m:
                        total += abs(logp[p - 1, t.token_ids[p]].item() - t.teacher_logprobs[p])
                        count += 1
        return total / count

    before = gap()
    for _ in range(12):
        assert "opd/reverse_kl" in tr.train_step(groups)
    assert gap() < 0.7 * before


def test_missing_candidates_are_refused() -> None:
    tr = TorchTrainer(TINY, {"opd": {"coef": 1.0, "candidates": "union"}})
    groups = random_groups(1, 2, teacher=-1.0)
    with pytest.raises(BatchError, match="trainer.opd.candidates needs teacher_candidate_ids"):
        tr.train_step(groups)
    groups[0].trajectories[0].teacher_logprobs = None
    with pytest.raises(BatchError, match="needs teacher_logprobs for every token"):
        tr.train_step(groups)

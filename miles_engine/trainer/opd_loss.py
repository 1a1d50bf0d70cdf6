"""On-policy distillation loss terms: per-token reverse-KL estimates to a teacher.

Notation at a sampled position ``t`` (the student sampled ``x_t``): ``s(c)`` is the current
student's log-prob of id ``c`` (temperature-scaled like every trainer log-prob), ``τ(c)`` the
teacher's, ``C`` the candidate set fixed at scoring time (:mod:`miles_engine.teachers.candidates`).

**Sampled token** (:func:`sampled_reverse_kl`): ``r = s(x_t) - τ(x_t)``; the value is ``r``
(the k1 estimate of ``KL(π_s || π_t)`` at ``t``, unbiased when ``x_t ~ π_s``) and the loss
surrogate is ``sg(r) · s(x_t)``, whose gradient ``r ∇s(x_t)`` is an unbiased estimate of
``∇ KL(π_s(·|t) || π_t(·|t))``. The teacher is a per-token reward ``-r``; no future tokens.

**Candidate set** (:func:`candidate_reverse_kl`): both distributions are renormalised on ``C``::

    ŝ(c) = s(c) - log Σ_{c'∈C} exp s(c')        τ̂(c) = τ(c) - log Σ_{c'∈C} exp τ(c')
    r(c) = ŝ(c) - τ̂(c)
    value  KL_t = Σ_{c∈C} exp ŝ(c) · r(c)        (= KL(p̂_s || p̂_t), exact on C, ≥ 0)
    loss   L_t  = Σ_{c∈C} sg(w(c) · r(c)) · ŝ(c)

with the weighting ``w``: ``student`` ``w = exp ŝ`` (then ``∇L_t = ∇KL_t`` exactly, since
``Σ p̂_s ∇ŝ = 0``); ``teacher`` ``w = exp τ̂``; ``uniform`` ``w = 1/|C|``. Every weighting
moves each candidate's log-prob against its log-ratio and has its fixed point at
``p̂_s = p̂_t`` on ``C``; the teacher and uniform weightings keep pulling on candidates the
student has nearly abandoned. The logged value is always ``KL_t``. An empty set (an empty
intersection) contributes neither loss nor value; rows of ``[rows, tokens, C]`` tensors are
padded with ``cand_mask = 0``.
"""

from __future__ import annotations

import torch
from torch import Tensor

WEIGHTINGS = ("student", "teacher", "uniform")
_FILL = -1e9  # log-prob of a padded candidate: exp() is exactly 0, gradients stay finite


def sampled_reverse_kl(logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(loss surrogate, value)`` per token ``[rows, tokens]``, 0 off the mask."""
    r = (logp.detach() - teacher_logp) * mask
    return r * logp * mask, r


def _renormalise(logp: Tensor, cand_mask: Tensor) -> Tensor:
    filled = logp.masked_fill(cand_mask <= 0, _FILL)
    return (filled - torch.logsumexp(filled, dim=-1, keepdim=True)).masked_fill(cand_mask <= 0, 0.0)


def candidate_reverse_kl(student_logp: Tensor, teacher_logp: Tensor, cand_mask: Tensor,
                         weighting: str = "student") -> tuple[Tensor, Tensor]:
    """``(loss surrogate, KL value)`` per token ``[rows, tokens]`` from ``[rows, tokens, C]``
    student log-probs (with grad), teacher log-probs and the candidate mask (see the module doc)."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown OPD weighting {weighting!r}; allowed: {', '.join(WEIGHTINGS)}")
    m = cand_mask.to(student_logp.dtype)
    s_hat = _renormalise(student_logp, m)
    t_hat = _renormalise(teacher_logp.to(student_logp.dtype), m)
    r = (s_hat - t_hat).detach() * m
    p_s = s_hat.detach().exp() * m
    if weighting == "student":
        w = p_s
    elif weighting == "teacher":
        w = t_hat.exp() * m
    else:
        w = m / m.sum(-1, keepdim=True).clamp(min=1.0)
    loss = ((w * r).detach() * s_hat).sum(-1)
    value = (p_s * r).sum(-1)
    return loss, value

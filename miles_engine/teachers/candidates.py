"""Candidate sets for top-K on-policy distillation, built when a trajectory is scored.

At every sampled position ``t`` (the student sampled ``x_t``) a candidate set ``C_t`` of token
ids is fixed at scoring time, together with the teacher's log-probs of its members:

- ``sampled``: no set; only the teacher's log-prob of ``x_t`` (the per-token k1 estimate).
- ``student_topk``: ``S_t``, the K most likely ids under the student that sampled the row
  (the rollout-time policy, scored right after the episode).
- ``teacher_topk``: ``T_t``, the teacher's K most likely ids.
- ``intersection``: ``S_t ∩ T_t`` (may be empty: that position then adds no loss).
- ``union``: ``S_t ∪ T_t`` (between K and 2K ids).

The trainer recomputes the *current* student's log-probs of every member and takes the
reverse KL between the two distributions renormalised on ``C_t``; the weighting of the
per-candidate terms is :data:`Weighting` (see :mod:`miles_engine.trainer.opd_loss`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

CandidateMode = Literal["sampled", "student_topk", "teacher_topk", "intersection", "union"]
Weighting = Literal["student", "teacher", "uniform"]
CANDIDATE_MODES: tuple[str, ...] = ("sampled", "student_topk", "teacher_topk", "intersection", "union")


def needs_student_topk(mode: CandidateMode) -> bool:
    return mode in ("student_topk", "intersection", "union")


def needs_teacher_topk(mode: CandidateMode) -> bool:
    return mode in ("teacher_topk", "intersection", "union")


def needs_teacher_candidates(mode: CandidateMode) -> bool:
    """Whether the teacher must score the student's ids it may not rank in its own top-K."""
    return mode in ("student_topk", "union")


def build_candidates(mode: CandidateMode, *, student_ids: Sequence[int] = (), teacher_ids: Sequence[int] = (),
                     teacher_top_logprobs: Sequence[float] = (),
                     teacher_student_logprobs: Sequence[float] = ()) -> tuple[list[int], list[float]]:
    """``(ids, teacher log-probs)`` of one position's candidate set.

    :param student_ids: the student's top-K ids (modes that use them).
    :param teacher_ids, teacher_top_logprobs: the teacher's top-K ids and their log-probs.
    :param teacher_student_logprobs: the teacher's log-probs of ``student_ids`` (same order).
    Order: teacher top-K order first, then student-only ids in student order; no duplicates.
    """
    if mode == "sampled":
        return [], []
    if mode == "student_topk":
        _same_length(student_ids, teacher_student_logprobs, "teacher log-probs of the student's top-K")
        return _dedupe(student_ids, teacher_student_logprobs)
    _same_length(teacher_ids, teacher_top_logprobs, "teacher top-K log-probs")
    if mode == "teacher_topk":
        return _dedupe(teacher_ids, teacher_top_logprobs)
    if mode == "intersection":
        wanted = set(student_ids)
        pairs = [(i, lp) for i, lp in zip(teacher_ids, teacher_top_logprobs) if i in wanted]
        return _dedupe([i for i, _ in pairs], [lp for _, lp in pairs])
    if mode == "union":
        _same_length(student_ids, teacher_student_logprobs, "teacher log-probs of the student's top-K")
        return _dedupe([*teacher_ids, *student_ids], [*teacher_top_logprobs, *teacher_student_logprobs])
    raise ValueError(f"unknown candidate mode {mode!r}; allowed: {', '.join(CANDIDATE_MODES)}")


def _same_length(ids: Sequence[int], lps: Sequence[float], what: str) -> None:
    if len(ids) != len(lps):
        raise ValueError(f"{what}: {len(lps)} values for {len(ids)} ids")


def _dedupe(ids: Sequence[int], lps: Sequence[float]) -> tuple[list[int], list[float]]:
    seen: set[int] = set()
    out_ids: list[int] = []
    out_lps: list[float] = []
    for i, lp in zip(ids, lps):
        if i not in seen:
            seen.add(i)
            out_ids.append(int(i))
            out_lps.append(float(lp))
    return out_ids, out_lps

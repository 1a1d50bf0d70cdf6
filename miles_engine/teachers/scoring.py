"""The post-episode step that attaches a teacher's scores to a finished trajectory.

It runs inside the episode task (after the verifier, before the group reaches the buffer),
so teacher forward passes overlap with other episodes instead of stalling the driver loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from miles_engine.rollout.types import Trajectory
from miles_engine.teachers.candidates import (
    CandidateMode,
    build_candidates,
    needs_student_topk,
    needs_teacher_candidates,
    needs_teacher_topk,
)
from miles_engine.teachers.compat import PROBE_TEXT, VocabFingerprint, check_compatible
from miles_engine.teachers.protocol import ScoreRequest, Teacher, TeacherError, TokenScores
from miles_engine.teachers.routing import TeacherRouter


def check_teachers(teachers: Mapping[str, Teacher], student: VocabFingerprint) -> None:
    """Refuse, at start-up, every teacher whose tokenizer maps ids differently from the student's."""
    for name, teacher in teachers.items():
        check_compatible(student, teacher.fingerprint(PROBE_TEXT, list(student.special_ids)), teacher_name=name)


def check_scores(scores: TokenScores, req: ScoreRequest, teacher: str) -> None:
    """Raise :class:`TeacherError` unless ``scores`` answers ``req`` in shape and range."""
    n, k = len(req.token_ids), req.top_k
    where = f"teacher '{teacher}'"
    if len(scores.logprobs) != n:
        raise TeacherError(f"{where} returned {len(scores.logprobs)} log-probs for {n} token ids")
    for p in req.positions:
        lp = scores.logprobs[p]
        if not (math.isfinite(lp) and lp <= 1e-4):
            raise TeacherError(f"{where}: log-prob {lp!r} at token {p} is not a finite log-probability")
    if k and (len(scores.top_ids) != len(req.positions) or len(scores.top_logprobs) != len(req.positions)
              or any(len(i) != len(v) or not 0 < len(i) <= k for i, v in zip(scores.top_ids, scores.top_logprobs))):
        raise TeacherError(f"{where}: top-{k} answer does not have up to {k} ids and log-probs per position")
    if req.candidate_ids is not None and (
            len(scores.candidate_logprobs) != len(req.positions)
            or any(len(c) != len(v) for c, v in zip(req.candidate_ids, scores.candidate_logprobs))):
        raise TeacherError(f"{where}: candidate log-probs do not match the candidate ids asked for")
    for values in (*scores.top_logprobs, *scores.candidate_logprobs):
        if any(not (math.isfinite(v) and v <= 1e-4) for v in values):
            raise TeacherError(f"{where}: a top-K or candidate log-prob is not a finite log-probability")


class TeacherScoring:
    """``await scoring(traj)``: route, score, validate, attach. Raises on a routing or teacher error.

    :param router: teachers by name with the routing rules.
    :param mode, top_k: what the trainer's OPD term needs (``trainer.opd.candidates / top_k``).
    :param student: scores the student's own top-K (``student_topk``, ``intersection``, ``union``).
    """

    def __init__(self, router: TeacherRouter[Teacher], *, mode: CandidateMode = "sampled", top_k: int = 8,
                 student: Any | None = None) -> None:
        if needs_student_topk(mode) and student is None:
            raise TeacherError(f"candidate mode {mode!r} needs a student scorer for the student's top-K")
        self.router, self.mode, self.top_k, self.student = router, mode, top_k, student
        self.scored = 0

    async def __call__(self, traj: Trajectory) -> None:
        if traj.status != "ok" or not traj.num_sampled:
            return
        sample = f"trajectory of task {traj.task_id!r}"
        name = self.router.name_for(traj.tags, sample=sample)
        teacher = self.router.teachers[name]
        positions = [i for i, m in enumerate(traj.loss_mask) if m]
        student_top: list[list[int]] | None = None
        if needs_student_topk(self.mode):
            (s,) = await self.student.score([ScoreRequest(traj.token_ids, positions, top_k=self.top_k)])
            student_top = s.top_ids
        req = ScoreRequest(traj.token_ids, positions, top_k=self.top_k if needs_teacher_topk(self.mode) else 0,
                           candidate_ids=student_top if needs_teacher_candidates(self.mode) else None)
        answers = await teacher.score([req])
        if len(answers) != 1:
            raise TeacherError(f"teacher '{name}' returned {len(answers)} answers for 1 request")
        scores = answers[0]
        check_scores(scores, req, name)
        self.attach(traj, positions, scores, student_top)
        traj.tags["teacher"] = name
        self.scored += 1

    def attach(self, traj: Trajectory, positions: Sequence[int], scores: TokenScores,
               student_top: list[list[int]] | None) -> None:
        traj.teacher_logprobs = [float(x) if m else 0.0 for x, m in zip(scores.logprobs, traj.loss_mask)]
        if self.mode == "sampled":
            return
        ids: list[list[int]] = [[] for _ in traj.token_ids]
        lps: list[list[float]] = [[] for _ in traj.token_ids]
        for j, p in enumerate(positions):
            ids[p], lps[p] = build_candidates(
                self.mode,
                student_ids=student_top[j] if student_top is not None else (),
                teacher_ids=scores.top_ids[j] if scores.top_ids else (),
                teacher_top_logprobs=scores.top_logprobs[j] if scores.top_logprobs else (),
                teacher_student_logprobs=scores.candidate_logprobs[j] if scores.candidate_logprobs else ())
        traj.teacher_candidate_ids, traj.teacher_candidate_logprobs = ids, lps

    async def aclose(self) -> None:
        for teacher in self.router.teachers.values():
            await teacher.aclose()

"""Routing by tag, candidate sets, the post-episode scoring step and its refusals."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles_engine.errors import ConfigError
from miles_engine.rollout.types import Trajectory
from miles_engine.teachers.candidates import build_candidates
from miles_engine.teachers.inprocess import LocalTeacher, LocalTeacherOptions, ModelScorer
from miles_engine.teachers.protocol import ScoreRequest, TeacherError, TokenScores
from miles_engine.teachers.routing import TeacherRouter, TeacherRoutingError
from miles_engine.teachers.scoring import TeacherScoring

pytestmark = pytest.mark.timeout(120)


def test_routes_by_tag_with_default() -> None:
    r = TeacherRouter({"math": 1, "shell": 2}, route_tag="kind", routes={"calc": "math"}, default="shell")
    assert r.route({"kind": "calc"}) == 1 and r.route({"kind": "echo"}) == 2 and r.route({}) == 2


def test_no_route_and_no_default_fails_loudly() -> None:
    r = TeacherRouter({"math": 1, "shell": 2}, route_tag="kind", routes={"calc": "math", "echo": "shell"})
    with pytest.raises(TeacherRoutingError, match=r"task 't9' has tag kind='grep', which matches no route .*calc, echo"):
        r.route({"kind": "grep"}, sample="task 't9'")
    with pytest.raises(TeacherRoutingError, match="no tag 'kind'"):
        r.route({})


@pytest.mark.parametrize("kwargs, message", [
    ({"teachers": {}}, "opd.teachers is empty"),
    ({"teachers": {"a": 1}, "routes": {"x": "b"}, "route_tag": "kind"}, "opd.routes.x names teacher 'b'"),
    ({"teachers": {"a": 1}, "default": "z"}, "opd.default names teacher 'z'"),
    ({"teachers": {"a": 1}, "routes": {"x": "a"}}, "opd.route_tag is not"),
    ({"teachers": {"a": 1, "b": 2}}, "neither opd.routes nor opd.default"),
])
def test_bad_routing_config(kwargs: dict, message: str) -> None:
    teachers = kwargs.pop("teachers")
    with pytest.raises(ConfigError, match=message):
        TeacherRouter(teachers, **kwargs)


def test_candidate_sets() -> None:
    kw = dict(student_ids=[5, 1, 9], teacher_ids=[1, 2, 5], teacher_top_logprobs=[-0.1, -2.0, -3.0],
              teacher_student_logprobs=[-3.0, -0.1, -7.0])
    assert build_candidates("teacher_topk", **kw) == ([1, 2, 5], [-0.1, -2.0, -3.0])
    assert build_candidates("student_topk", **kw) == ([5, 1, 9], [-3.0, -0.1, -7.0])
    assert build_candidates("intersection", **kw) == ([1, 5], [-0.1, -3.0])
    assert build_candidates("union", **kw) == ([1, 2, 5, 9], [-0.1, -2.0, -3.0, -7.0])
    assert build_candidates("intersection", **{**kw, "student_ids": [7]}) == ([], [])
    assert build_candidates("sampled", **kw) == ([], [])


def _traj(ids: list[int], sampled_from: int, tags: dict[str, str] | None = None) -> Trajectory:
    mask = [0] * sampled_from + [1] * (len(ids) - sampled_from)
    return Trajectory(list(ids), mask, [-1.0 if m else 0.0 for m in mask], [0 if m else None for m in mask],
                      reward=1.0, task_id="t1", tags=dict(tags or {}))


@pytest.mark.parametrize("mode", ["sampled", "student_topk", "teacher_topk", "intersection", "union"])
def test_scoring_step_attaches_exactly_what_the_trainer_reads(mode: str, teacher_dir: Path, student_tok) -> None:
    teacher = LocalTeacher(LocalTeacherOptions(model=str(teacher_dir)))
    student = LocalTeacher(LocalTeacherOptions(model=str(teacher_dir), seed=3, temperature=2.0)).scorer
    ids = student_tok.encode("echo hello world > greeting.txt")
    traj = _traj(ids, 3, {"kind": "echo"})
    scoring = TeacherScoring(TeacherRouter({"t": teacher}), mode=mode, top_k=3, student=student)
    asyncio.run(scoring(traj))
    (ref,) = asyncio.run(teacher.score([ScoreRequest(ids, list(range(3, len(ids))), top_k=3)]))
    assert traj.teacher_logprobs == [ref.logprobs[i] if m else 0.0 for i, m in enumerate(traj.loss_mask)]
    assert traj.tags["teacher"] == "t"
    if mode == "sampled":
        assert traj.teacher_candidate_ids is None
        return
    assert len(traj.teacher_candidate_ids) == len(ids) == len(traj.teacher_candidate_logprobs)
    for p, (cand, lp) in enumerate(zip(traj.teacher_candidate_ids, traj.teacher_candidate_logprobs)):
        if not traj.loss_mask[p]:
            assert cand == [] and lp == []
            continue
        (full,) = asyncio.run(teacher.score([ScoreRequest(ids, [p], candidate_ids=[cand])]))
        assert lp == pytest.approx(full.candidate_logprobs[0], abs=1e-5)  # the teacher's log-prob of each member
        if mode in ("teacher_topk", "union"):
            assert cand[:3] == ref.top_ids[p - 3]


def test_student_modes_need_a_student_scorer() -> None:
    with pytest.raises(TeacherError, match="needs a student scorer"):
        TeacherScoring(TeacherRouter({"t": object()}), mode="union")


class _Broken:
    name = "broken"

    def __init__(self, answer: TokenScores) -> None:
        self.answer = answer

    async def score(self, requests):
        return [self.answer]

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("answer, message", [
    (TokenScores([0.0, -1.0]), "returned 2 log-probs for 4 token ids"),
    (TokenScores([0.0, 0.0, 0.5, -1.0]), "log-prob 0.5 at token 2"),
    (TokenScores([0.0, 0.0, float("nan"), -1.0]), "nan"),
])
def test_malformed_teacher_answers_are_refused(answer: TokenScores, message: str) -> None:
    scoring = TeacherScoring(TeacherRouter({"broken": _Broken(answer)}))
    with pytest.raises(TeacherError, match=message):
        asyncio.run(scoring(_traj([1, 2, 3, 4], 2)))


def test_failed_trajectories_are_not_scored() -> None:
    traj = _traj([1, 2, 3, 4], 2)
    traj.status = "failed"
    asyncio.run(TeacherScoring(TeacherRouter({"broken": _Broken(TokenScores([]))}))(traj))
    assert traj.teacher_logprobs is None


def test_model_scorer_refuses_out_of_vocabulary_ids(teacher_dir: Path) -> None:
    scorer: ModelScorer = LocalTeacher(LocalTeacherOptions(model=str(teacher_dir))).scorer
    with pytest.raises(TeacherError, match="outside the teacher's vocabulary"):
        scorer.score_one(ScoreRequest([1, 10**6], [1]))

"""Refusals: unreachable URL, malformed / short / misaligned answers, 4xx vs retried 5xx,
credentials, tokenizer-info gaps, options; and the scoring step end to end over HTTP."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from miles_teacher_served import ServedTeacher, ServedTeacherOptions

from miles_engine.errors import ConfigError
from miles_engine.hub import Hub
from miles_engine.rollout.types import Trajectory
from miles_engine.teachers.compat import PROBE_TEXT
from miles_engine.teachers.inprocess import (
    LocalTeacher,
    LocalTeacherOptions,
    ModelScorer,
)
from miles_engine.teachers.protocol import ScoreRequest, TeacherError
from miles_engine.teachers.routing import TeacherRouter
from miles_engine.teachers.scoring import TeacherScoring

pytestmark = pytest.mark.timeout(60)
KEY_ENV = "FAKE_SGLANG_KEY"


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 30))


def _score(teacher: ServedTeacher, reqs: list[ScoreRequest]):  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        try:
            return await teacher.score(reqs)
        finally:
            await teacher.aclose()
    return _run(go())


@pytest.fixture
def row(student_tok) -> list[int]:
    return student_tok.encode("echo hello world > greeting.txt")


@pytest.fixture
def sglang(sglang_server, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv(KEY_ENV, "sk-test")
    sglang_server.app.state.faults.clear()
    yield sglang_server
    sglang_server.app.state.faults.clear()


def _teacher(url: str, **kw) -> ServedTeacher:  # type: ignore[no-untyped-def]
    return ServedTeacher(ServedTeacherOptions(url=url, api_key_env=KEY_ENV, backoff_s=0.01, **kw))


def test_unreachable_url_is_one_error_naming_it(row: list[int]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    url = f"http://127.0.0.1:{port}"
    teacher = ServedTeacher(ServedTeacherOptions(url=url, retries=2, backoff_s=0.01))
    with pytest.raises(TeacherError, match=rf"teacher 'served' \({url}/generate\) did not answer after 3 attempt\(s\): "
                                           rf"ConnectError"):
        _score(teacher, [ScoreRequest(row, [1, 2])])
    with pytest.raises(TeacherError, match=rf"{url}/get_model_info\) did not answer"):
        teacher.fingerprint(PROBE_TEXT, ["<|im_start|>"])


@pytest.mark.parametrize("fault, message", [
    ("drop", r"meta_info.input_token_logprobs is missing or not a list"),
    ("short", r"meta_info.input_token_logprobs has 8 entries for 9 tokens from logprob_start_len: length mismatch"),
    ("shift", r"meta_info.input_token_logprobs\[1\] is for token id \d+ but token 1 of the row is \d+"),
    ("garbage", r"malformed answer: no meta_info object"),
    ("400", r"answered HTTP 400: bad request from the fake"),
])
def test_malformed_answers_are_refused_naming_the_field(sglang, row: list[int], fault: str, message: str) -> None:
    assert len(row) == 9, row  # the messages above count this row's tokens
    sglang.app.state.faults.append(fault)
    with pytest.raises(TeacherError, match=message):
        _score(_teacher(sglang.url), [ScoreRequest(row, list(range(1, len(row))))])
    assert sglang.app.state.faults == []  # one request: refusals are not retried


def test_5xx_is_retried_then_answers(sglang, row: list[int]) -> None:
    sglang.app.state.faults.extend(["503", "503"])
    (ans,) = _score(_teacher(sglang.url, retries=2), [ScoreRequest(row, [2, 3])])
    assert ans.logprobs[2] < 0 and ans.logprobs[3] < 0
    sglang.app.state.faults.extend(["503", "503"])
    with pytest.raises(TeacherError, match=r"did not answer after 2 attempt\(s\): HTTP 503: overloaded"):
        _score(_teacher(sglang.url, retries=1), [ScoreRequest(row, [2])])


def test_credentials(sglang, monkeypatch: pytest.MonkeyPatch, row: list[int]) -> None:
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ConfigError, match=f"environment variable {KEY_ENV} \\(options.api_key_env\\) is not set"):
        _teacher(sglang.url)
    teacher = ServedTeacher(ServedTeacherOptions(url=sglang.url))  # no key at all
    with pytest.raises(TeacherError, match="answered HTTP 401: Unauthorized") as info:
        _score(teacher, [ScoreRequest(row, [1])])
    assert "sk-test" not in str(info.value)


def test_tokenizer_info(sglang, miles_server, student_tok, teacher_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"reports no tokenizer_vocab_size \(real SGLang does not\): set "
                                          r"options.vocab_size"):
        _teacher(sglang.url).fingerprint(PROBE_TEXT, ["<|im_start|>"])
    local = LocalTeacher(LocalTeacherOptions(model=str(teacher_dir))).fingerprint(PROBE_TEXT, ["<|im_start|>"])
    assert _teacher(sglang.url, vocab_size=student_tok.vocab_size).fingerprint(PROBE_TEXT, ["<|im_start|>"]) == local
    assert ServedTeacher(ServedTeacherOptions(url=miles_server.url)).fingerprint(PROBE_TEXT, ["<|im_start|>"]) == local
    by_file = ServedTeacher(ServedTeacherOptions(url="http://127.0.0.1:9", tokenizer=str(teacher_dir)))
    assert by_file.fingerprint(PROBE_TEXT, ["<|im_start|>"]) == local  # the server is not asked


def test_top_k_option_below_the_request_is_refused(miles_server, row: list[int]) -> None:
    teacher = ServedTeacher(ServedTeacherOptions(url=miles_server.url, top_k=2))
    with pytest.raises(TeacherError, match=r"options.top_k=2 is below the top-4"):
        _score(teacher, [ScoreRequest(row, [1], top_k=4)])
    (ans,) = _score(ServedTeacher(ServedTeacherOptions(url=miles_server.url, top_k=8)),
                    [ScoreRequest(row, [1, 2], top_k=3)])
    assert [len(t) for t in ans.top_ids] == [3, 3]


@pytest.mark.parametrize("options, message", [
    ({}, "url"),
    ({"url": "127.0.0.1:30000"}, "must start with http://"),
    ({"url": "http://x", "retries": -1}, "retries"),
    ({"url": "http://x", "max_concurrency": 0}, "max_concurrency"),
    ({"url": "http://x", "tokenzier": "t"}, "tokenzier"),
])
def test_bad_options_are_named(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Hub().create("teacher", "served", options)


def test_concurrency_is_bounded(miles_server, student_tok) -> None:
    teacher = ServedTeacher(ServedTeacherOptions(url=miles_server.url, max_concurrency=2, max_batch_rows=3))
    rows = [student_tok.encode(f"echo {i} > f{i}.txt") for i in range(7)]
    answers = _score(teacher, [ScoreRequest(r, list(range(1, len(r)))) for r in rows])
    assert len(answers) == 7 and teacher.requests_sent == 7
    assert all(a.logprobs[-1] < 0 for a in answers)


def _traj(ids: list[int], sampled_from: int) -> Trajectory:
    mask = [0] * sampled_from + [1] * (len(ids) - sampled_from)
    return Trajectory(list(ids), mask, [-1.0 if m else 0.0 for m in mask], [0 if m else None for m in mask],
                      reward=1.0, task_id="t1", tags={"kind": "echo"})


@pytest.mark.parametrize("mode", ["sampled", "union", "intersection", "student_topk", "teacher_topk"])
def test_scoring_step_over_http_matches_the_local_teacher(mode: str, miles_server, teacher_dir: Path,
                                                          student_tok) -> None:
    """TeacherScoring (the post-episode OPD step) attaches the same values through either teacher."""
    student = ModelScorer(LocalTeacher(LocalTeacherOptions(model=str(teacher_dir), seed=3)).scorer.model,
                          temperature=2.0)
    ids = student_tok.encode("<|im_start|>user\nwhat is 17 * 3?<|im_end|>\n<|im_start|>assistant\n51<|im_end|>")
    results = []
    for teacher in (ServedTeacher(ServedTeacherOptions(url=miles_server.url), name="drills"),
                    LocalTeacher(LocalTeacherOptions(model=str(teacher_dir)), name="drills")):
        traj = _traj(ids, 6)
        scoring = TeacherScoring(TeacherRouter({"drills": teacher}), mode=mode, top_k=4, student=student)
        _run(scoring(traj))
        _run(scoring.aclose())
        results.append(traj)
    served, local = results
    assert served.tags["teacher"] == "drills"
    assert max(abs(a - b) for a, b in zip(served.teacher_logprobs, local.teacher_logprobs)) <= 1e-5
    assert served.teacher_candidate_ids == local.teacher_candidate_ids
    if mode != "sampled":
        flat = lambda t: [v for row in t.teacher_candidate_logprobs for v in row]
        assert max((abs(a - b) for a, b in zip(flat(served), flat(local))), default=0.0) <= 1e-5

"""The served teacher passes the teacher contract suite against miles' HTTP server (tiny model,
embedded engine) and a fake SGLang server, and scores exactly like the in-process teacher."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from miles_teacher_served import ServedTeacher, ServedTeacherOptions

from miles_engine.hub import Hub
from miles_engine.teachers.inprocess import LocalTeacher, LocalTeacherOptions
from miles_engine.teachers.protocol import ScoreRequest
from miles_engine.testing.teacher import TeacherContract

pytestmark = pytest.mark.timeout(120)


class TestServedByMilesServer(TeacherContract):
    @pytest.fixture
    def teacher(self, miles_server) -> ServedTeacher:
        return Hub().create("teacher", "served", {"url": miles_server.url})

    @pytest.fixture
    def generation_calls(self, miles_server):
        before = len(miles_server.generate_calls)
        return lambda: len(miles_server.generate_calls) - before

    @pytest.fixture
    def student_tokenizer(self, student_tok):
        return student_tok


class TestServedBySGLang(TeacherContract):
    @pytest.fixture
    def teacher(self, sglang_server, student_tok, monkeypatch: pytest.MonkeyPatch) -> ServedTeacher:
        monkeypatch.setenv("FAKE_SGLANG_KEY", "sk-test")
        return Hub().create("teacher", "served", {"url": sglang_server.url, "api_key_env": "FAKE_SGLANG_KEY",
                                                  "vocab_size": student_tok.vocab_size})

    @pytest.fixture
    def generation_calls(self, sglang_server):
        before = sglang_server.app.state.generate_calls
        return lambda: sglang_server.app.state.generate_calls - before

    @pytest.fixture
    def student_tokenizer(self, student_tok):
        return student_tok


def _requests(tok) -> list[ScoreRequest]:
    out = []
    for text, first in (("echo hello world > greeting.txt", 1), ("the answer is 42\n", 3),
                        ("<|im_start|>user\nls -la /tmp && cat notes.md<|im_end|>", 5)):
        row = tok.encode(text)
        positions = list(range(first, len(row)))
        out.append(ScoreRequest(row, positions, top_k=5, candidate_ids=[[row[p], 7, row[0]] for p in positions]))
    return out


@pytest.mark.parametrize("server", ["miles_server", "sglang_server"])
def test_equals_the_local_teacher_within_1e_5(server: str, request: pytest.FixtureRequest, teacher_dir: Path,
                                              student_tok, monkeypatch: pytest.MonkeyPatch) -> None:
    srv = request.getfixturevalue(server)
    monkeypatch.setenv("FAKE_SGLANG_KEY", "sk-test")
    served = ServedTeacher(ServedTeacherOptions(url=srv.url, api_key_env="FAKE_SGLANG_KEY"))
    local = LocalTeacher(LocalTeacherOptions(model=str(teacher_dir)))
    reqs = _requests(student_tok)

    async def both():
        try:
            return await served.score(reqs), await local.score(reqs)
        finally:
            await served.aclose()
    got, want = asyncio.run(asyncio.wait_for(both(), 60))
    for g, w, req in zip(got, want, reqs):
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) <= 1e-5
        assert g.top_ids == w.top_ids
        for gl, wl in zip(g.top_logprobs, w.top_logprobs):
            assert max(abs(a - b) for a, b in zip(gl, wl)) <= 1e-5
        for gl, wl in zip(g.candidate_logprobs, w.candidate_logprobs):
            assert max(abs(a - b) for a, b in zip(gl, wl)) <= 1e-5
        assert all(g.logprobs[i] == 0.0 for i in range(len(req.token_ids)) if i not in req.positions)


def test_registered_by_entry_point() -> None:
    reg = Hub().get("teacher", "served")
    assert not reg.builtin and reg.component.options is ServedTeacherOptions

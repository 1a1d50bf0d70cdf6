"""The teacher contract suite: every teacher plugin's tests subclass :class:`TeacherContract`.

Supply three fixtures in the subclass::

    class TestMyTeacher(TeacherContract):
        @pytest.fixture
        def teacher(self):               # a built teacher (closed by the suite)
            ...
        @pytest.fixture
        def student_tokenizer(self):     # a tokenizer with exactly the teacher's ids
            ...
        @pytest.fixture
        def generation_calls(self):      # () -> how many generate/sample calls the backend saw
            ...

and optionally override ``other_tokenizer`` (a tokenizer mapping ids differently; default a
byte-level BPE trained on a different corpus). Every test below then runs against the teacher.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import pytest

from miles_engine.errors import ConfigError
from miles_engine.models.bpe import BPE_ADDED_TOKENS, train_bpe
from miles_engine.models.tokenizer import TitoTokenizer, load_tokenizer
from miles_engine.teachers.compat import PROBE_TEXT, fingerprint_tokenizer
from miles_engine.teachers.protocol import ScoreRequest, Teacher
from miles_engine.teachers.scoring import check_scores, check_teachers

TEXTS = ("echo hello world > greeting.txt", "the answer is 42\n", "ls -la /tmp && cat notes.md")


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


def _rows(tokenizer: Any) -> list[list[int]]:
    tok = load_tokenizer(tokenizer)
    rows = [tok.encode(t) for t in TEXTS]
    rows = [r if len(r) >= 3 else r + tok.encode(" and more text") for r in rows]
    return rows


def _differently_mapped_tokenizer() -> Any:
    corpus = ["zebra quartz jumps vexingly over fjord nymphs " * 3, "0123456789 {}[]:;,.\"'", PROBE_TEXT[::-1]]
    return TitoTokenizer(train_bpe(corpus * 20, vocab_size=300, added=BPE_ADDED_TOKENS["chatml"]), name="other")


class TeacherContract:
    top_k = 4

    @pytest.fixture
    def other_tokenizer(self) -> Any:
        return _differently_mapped_tokenizer()

    @pytest.fixture
    def live(self, teacher: Teacher) -> Any:
        """The teacher under test, closed after the test whatever happens."""
        yield teacher

    @pytest.fixture
    def scored(self, live: Teacher, student_tokenizer: Any) -> tuple[list[ScoreRequest], list[Any]]:
        requests = []
        for row in _rows(student_tokenizer):
            positions = list(range(1, len(row)))
            cands = [[row[p], row[0]] for p in positions]
            requests.append(ScoreRequest(row, positions, top_k=self.top_k, candidate_ids=cands))
        return requests, _run(live.score(requests))

    def test_one_answer_per_request_shaped_like_the_ids(self, live: Teacher, scored: Any) -> None:
        requests, answers = scored
        assert len(answers) == len(requests)
        for req, ans in zip(requests, answers):
            assert len(ans.logprobs) == len(req.token_ids)
            check_scores(ans, req, live.name)
            assert ans.logprobs[0] == 0.0  # the first token has no predicting position

    def test_logprobs_are_finite_and_at_most_zero(self, scored: Any) -> None:
        requests, answers = scored
        for req, ans in zip(requests, answers):
            for p in req.positions:
                assert math.isfinite(ans.logprobs[p]) and ans.logprobs[p] <= 1e-6

    def test_top_k_is_sorted_and_consistent_with_the_token_scores(self, scored: Any) -> None:
        requests, answers = scored
        for req, ans in zip(requests, answers):
            for j, p in enumerate(req.positions):
                ids, lps = ans.top_ids[j], ans.top_logprobs[j]
                assert len(ids) == self.top_k and len(set(ids)) == self.top_k
                assert all(a >= b - 1e-6 for a, b in zip(lps, lps[1:]))
                assert ans.logprobs[p] <= lps[0] + 1e-4  # nothing beats the top-1
                assert sum(math.exp(v) for v in lps) <= 1.0 + 1e-4
                if req.token_ids[p] in ids:
                    assert lps[ids.index(req.token_ids[p])] == pytest.approx(ans.logprobs[p], abs=1e-4)
                # the candidate list asked for [this token, the row's first token]
                assert ans.candidate_logprobs[j][0] == pytest.approx(ans.logprobs[p], abs=1e-4)

    def test_deterministic_for_the_same_ids(self, live: Teacher, student_tokenizer: Any) -> None:
        row = _rows(student_tokenizer)[0]
        req = ScoreRequest(row, list(range(1, len(row))), top_k=self.top_k)
        first, second = _run(live.score([req])), _run(live.score([req]))
        assert first[0].logprobs == second[0].logprobs and first[0].top_ids == second[0].top_ids

    def test_only_requested_positions_are_scored(self, live: Teacher, student_tokenizer: Any) -> None:
        row = _rows(student_tokenizer)[2]
        positions = [1, len(row) - 1]
        (ans,) = _run(live.score([ScoreRequest(row, positions)]))
        assert len(ans.logprobs) == len(row)
        assert all(v == 0.0 for i, v in enumerate(ans.logprobs) if i not in positions)
        assert ans.logprobs[len(row) - 1] < 0.0

    def test_never_generates(self, scored: Any, generation_calls: Callable[[], int]) -> None:
        assert scored[1]
        assert generation_calls() == 0

    def test_accepts_the_student_tokenizer(self, live: Teacher, student_tokenizer: Any) -> None:
        student = fingerprint_tokenizer(student_tokenizer, PROBE_TEXT, ["<|im_start|>", "<|im_end|>"])
        check_teachers({live.name: live}, student)

    def test_refuses_a_differently_mapped_tokenizer(self, live: Teacher, other_tokenizer: Any) -> None:
        student = fingerprint_tokenizer(other_tokenizer, PROBE_TEXT, ["<|im_start|>", "<|im_end|>"])
        with pytest.raises(ConfigError, match=f"teacher '{live.name}'"):
            check_teachers({live.name: live}, student)

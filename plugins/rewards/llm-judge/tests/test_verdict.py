"""Reading the judge's verdict: the formats judges use, and garbage that must fail."""

from __future__ import annotations

import pytest

from miles_reward_llm_judge.verdict import VerdictError, parse_verdict


@pytest.mark.parametrize(("text", "reward", "raw"), [
    ("SCORE: 7", 0.7, 7.0),
    ("reasoning...\n**Score:** 10", 1.0, 10.0),
    ("Score = 3/5", 0.6, 3.0),
    ("rating: 4 out of 4", 1.0, 4.0),
    ('{"score": 2.5, "why": "partly"}', 0.25, 2.5),
    ("SCORE: 1\nOn reflection, SCORE: 9", 0.9, 9.0),
    ("<think>SCORE: 0 maybe</think>VERDICT: CORRECT", 1.0, 1.0),
    ("Verdict: incorrect.", 0.0, 0.0),
])
def test_verdicts(text, reward, raw):
    assert parse_verdict(text, scale=10) == pytest.approx((reward, raw))


@pytest.mark.parametrize(("text", "needle"), [
    ("", "empty answer"),
    ("   ", "empty answer"),
    ("I think it is quite good", "no verdict"),
    ("SCORE: 11", "outside 0..10"),
    ("SCORE: -1", "outside 0..10"),
    ("Score: 5/0", "not a usable number"),
    ('{"score": "high"}', "no verdict"),
    ('{"score": true}', "no verdict"),
    ("<think>SCORE: 8</think>", "no verdict"),
    ("\x00\xff" * 1000, "no verdict"),
])
def test_garbage_verdicts_fail(text, needle):
    with pytest.raises(VerdictError, match=needle):
        parse_verdict(text, scale=10)

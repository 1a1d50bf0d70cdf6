"""pass@k, standard errors and bootstrap intervals against values computed by hand."""

from __future__ import annotations

import math

import pytest

from miles_engine.evaluation.stats import (
    TaskOutcome,
    bootstrap_interval,
    estimate,
    paired_difference,
    pass_at_k,
    standard_error,
    summarize,
)


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (5, 2, 1, 2 / 5),
    (5, 2, 2, 1 - 3 / 10),        # 1 - C(3,2)/C(5,2)
    (10, 3, 5, 1 - 21 / 252),     # 1 - C(7,5)/C(10,5)
    (5, 2, 4, 1.0),               # n - c < k: every k-subset holds a pass
    (4, 0, 2, 0.0),
    (4, 4, 1, 1.0),
])
def test_pass_at_k_matches_the_binomial_formula(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    if n - c >= k:
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_refuses_k_above_the_attempts() -> None:
    with pytest.raises(ValueError, match="pass@5 needs 1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_standard_error_by_hand() -> None:
    assert standard_error([0, 1, 1, 0]) == pytest.approx(math.sqrt((1 / 3) / 4))  # var (ddof=1) = 1/3
    assert math.isnan(standard_error([1.0]))


def test_bootstrap_interval_against_the_exact_resampling_distribution() -> None:
    # means of resamples of [0, 0, 1]: k/3 with k ~ Binomial(3, 1/3); P(mean <= 2/3) = 26/27 < 0.975
    assert bootstrap_interval([0, 0, 1], seed=1) == (0.0, 1.0)
    assert bootstrap_interval([0.25] * 7, seed=3) == (0.25, 0.25)
    # 140 passes in 200 tasks: normal approximation 0.7 +- 1.96 * sqrt(0.21 / 199)
    low, high = bootstrap_interval([1.0] * 140 + [0.0] * 60, seed=0)
    half = 1.96 * math.sqrt(0.7 * 0.3 / 199)
    assert low == pytest.approx(0.7 - half, abs=0.015) and high == pytest.approx(0.7 + half, abs=0.015)
    assert bootstrap_interval([0, 1, 1, 0, 1], seed=5) == bootstrap_interval([0, 1, 1, 0, 1], seed=5)


def test_summarize_excludes_errored_attempts_and_short_tasks_from_pass_at_k() -> None:
    outcomes = [TaskOutcome("a", (1, 0, 1, 1), (True, False, True, True)),
                TaskOutcome("b", (0, 0, 0, 0), (False,) * 4),
                TaskOutcome("c", (1, 1), (True, True), errors=2),
                TaskOutcome("d", (), (), errors=4)]
    s = summarize(outcomes, [1, 4], seed=0)
    assert s["reward"].value == pytest.approx((0.75 + 0 + 1) / 3) and s["reward"].n == 3
    assert s["pass@1"].value == pytest.approx((0.75 + 0 + 1) / 3)
    assert s["pass@4"].value == pytest.approx(0.5) and s["pass@4"].n == 2  # a: 1, b: 0; c has 2 attempts
    assert s["reward"].se == pytest.approx(standard_error([0.75, 0.0, 1.0]))
    assert s["reward"].low <= s["reward"].value <= s["reward"].high


def test_paired_difference_uses_only_shared_tasks() -> None:
    after = {"t1": 1.0, "t2": 1.0, "t3": 0.5}
    before = {"t1": 0.0, "t2": 1.0, "t3": 0.5, "t4": 1.0}
    d = paired_difference(after, before, seed=1)
    assert (d.value, d.n) == (pytest.approx(1 / 3), 3)
    assert d.se == pytest.approx(1 / 3)  # diffs [1, 0, 0]: var (ddof=1) 1/3, over 3 tasks
    assert (d.low, d.high) == (0.0, 1.0)  # the resampling distribution of [1, 0, 0], as above
    assert estimate([]).n == 0 and math.isnan(estimate([]).value)

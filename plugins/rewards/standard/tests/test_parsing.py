"""Math answer extraction/normalisation and pytest report parsing, including hostile inputs."""

from __future__ import annotations

import time

import pytest
from rewards_testkit import real_pytest_run

from miles_rewards.mathnorm import answers_match, extract_answer, normalize, to_number
from miles_rewards.pytest_fraction import PytestCounts, ReportError, parse_junit, parse_summary


@pytest.mark.parametrize(("text", "answer"), [
    (r"thus \boxed{\frac{1}{2}} and \boxed{7}", "7"),
    (r"\boxed{\frac{a}{\sqrt{b}}}", r"\frac{a}{\sqrt{b}}"),
    (r"\fbox{3}", "3"),
    (r"\boxed 5 is it", "5"),
    ("so\n#### 1,234\n", "1,234"),
    ("The answer is: -3.5.", "-3.5."),
    ("costs 3 apples and 12.50 dollars", "12.50"),
    ("no numbers here", None),
])
def test_extract(text, answer):
    assert extract_answer(text) == answer


def test_extract_modes():
    assert extract_answer("answer is 4 but 5", "last_number") == "5"
    assert extract_answer("answer is 4", "boxed") is None


@pytest.mark.parametrize(("predicted", "reference"), [
    ("0.50", "1/2"), (r"\dfrac{1}{2}", "0.5"), (r"\tfrac12", ".5"), ("1,000,000", "1000000"),
    ("1e3", "1000"), (r"12\text{ cm}", "12"), ("12 cm", "12"), (r"45^\circ", "45"), (r"45^{\circ}", "45"),
    (r"50\%", "50"), (r"\$5", "5"), ("x = 3", "3"), (r"\left( 2 \right)", "2"), (r"2\pi", "6.283185307"),
    (r"\frac{\sqrt{3}}{2}", "0.8660254"), ("2^{10}", "1024"), ("(B)", "B"), ("Paris", "paris"), ("3.", "3"),
])
def test_equivalent_answers(predicted, reference):
    assert answers_match(predicted, reference, rel_tol=1e-6)


@pytest.mark.parametrize(("predicted", "reference"), [
    ("0.51", "1/2"), ("-3", "3"), ("1/0", "0"), ("12", "123"), ("A", "B"), ("", ""), ("1,23", "123"),
])
def test_different_answers(predicted, reference):
    assert not answers_match(predicted, reference)


def test_tolerance_is_an_option():
    assert answers_match("3.1416", r"\pi", rel_tol=1e-4) and not answers_match("3.1416", r"\pi", rel_tol=1e-7)


@pytest.mark.parametrize("hostile", ["9**9**9**9", "2^{2^{2^{2^{2^{2}}}}}", "(" * 500 + "1" + ")" * 500, "(-8)^{1/3}",
                                     r"\sqrt{-1}", "1/(1-1)", "1" * 190, "__import__('os')"])
def test_number_evaluation_is_bounded_and_safe(hostile):
    t0 = time.perf_counter()
    value = to_number(normalize(hostile))
    assert value is None or isinstance(value, (int, float)) or value.denominator >= 1
    assert time.perf_counter() - t0 < 1.0


def test_extraction_on_huge_hostile_text_is_fast():
    t0 = time.perf_counter()
    extract_answer("\\boxed{" * 5000 + "1" * 100_000)
    assert time.perf_counter() - t0 < 2.0


def test_real_junit_and_summary_agree():
    junit, output = real_pytest_run()
    assert parse_junit(junit) == parse_summary(output) == PytestCounts(passed=2, failed=1, errors=1, skipped=1)


@pytest.mark.parametrize(("output", "counts"), [
    ("===== 3 passed, 1 xfailed, 1 xpassed, 2 warnings in 0.50s =====", PytestCounts(4, 0, 0, 1)),
    ("1 failed, 2 errors in 1.00s\n", PytestCounts(0, 1, 2, 0)),
    ("==== 5 passed in 3.21 seconds ====", PytestCounts(5, 0, 0, 0)),
    ("=== no tests ran in 0.01s ===", PytestCounts(0, 0, 0, 0)),
])
def test_summary_lines(output, counts):
    assert parse_summary("noise\n" + output) == counts


def test_summary_is_linear_on_hostile_output():
    t0 = time.perf_counter()
    with pytest.raises(ReportError):
        parse_summary(("1 1" * 120 + "\n") * 2000)
    assert time.perf_counter() - t0 < 2.0


@pytest.mark.parametrize(("data", "needle"), [(b"<testsuites", "not valid XML"), (b"<html/>", "root element is <html>")])
def test_bad_junit(data, needle):
    with pytest.raises(ReportError, match=needle):
        parse_junit(data)


def test_junit_collection_error_counts_suite_errors():
    xml = b'<testsuites><testsuite name="pytest" errors="1" failures="0" skipped="0" tests="1"></testsuite></testsuites>'
    assert parse_junit(xml) == PytestCounts(0, 0, 1, 0)

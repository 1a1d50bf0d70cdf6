"""Every terminal-bench parser on output in the format its benchmark's grader prints (fixtures/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_env_terminal_bench.graders import GRADERS, expected, grade

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize(
    ("parser", "fixture", "passed", "test_name"),
    [("swebench", "swebench_resolved.txt", True, "tests"),
     ("swebench", "swebench_unresolved.txt", False, "tests"),
     ("sweperf", "sweperf_improved.txt", True, "tests"),
     ("mlebench", "mlebench_passed.txt", True, "tests"),
     ("mlebench", "mlebench_failed.txt", False, "tests"),
     ("swelancer", "swelancer_ic_success.txt", True, "swelancer_task"),
     ("swelancer", "swelancer_manager_failure.txt", False, "swelancer_task")],
)
def test_each_grader_reads_its_benchmarks_verdict(parser, fixture, passed, test_name):
    summary = grade(parser, (FIXTURES / fixture).read_text())
    assert summary is not None and summary.resolved is passed
    assert summary.tests == {test_name: "PASSED" if passed else "FAILED"}
    assert (summary.passed, summary.failed) == ((1, 0) if passed else (0, 1))


def test_the_pytest_lines_before_the_swebench_markers_do_not_decide():
    # the unresolved log has a pytest summary with one pass; only the block between the markers counts
    assert grade("swebench", (FIXTURES / "swebench_unresolved.txt").read_text()).resolved is False
    assert grade("pytest", (FIXTURES / "swebench_unresolved.txt").read_text()).passed == 1


@pytest.mark.parametrize(("parser", "fixture"), [("swebench", "swebench_no_markers.txt"),
                                                 ("sweperf", "swebench_resolved.txt"),
                                                 ("swelancer", "swelancer_no_verdict.txt")])
def test_no_verdict_is_no_summary_not_a_failure(parser, fixture):
    """A grader that never printed its verdict (the repository could not be fetched; another
    benchmark's markers; only 'user_tool … completed') gives no summary: an error, never reward 0."""
    assert grade(parser, (FIXTURES / fixture).read_text()) is None
    assert expected(parser).startswith("no ")


def test_markers_in_colour_and_crlf_are_read():
    text = "\x1b[32mSWEBench results starts here\x1b[0m\r\nPASSED\r\nSWEBench results ends here\r\n"
    assert grade("swebench", text).resolved


def test_mlebench_without_markers_reads_the_whole_output():
    assert grade("mlebench", "ALL TESTS PASSED\n").resolved
    assert not grade("mlebench", "ALL TESTS PASSED\nbut then something else\n").resolved


def test_every_grader_is_listed():
    assert set(GRADERS) == {"pytest", "swebench", "sweperf", "mlebench", "swelancer"}

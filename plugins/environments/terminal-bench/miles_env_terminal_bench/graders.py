"""Every ``parser_name`` terminal-bench ships: how each reads the output of ``run-tests.sh``.

- ``pytest``: pytest's console output (:mod:`miles_env_terminal_bench.parser`).
- ``swebench`` / ``sweperf``: the task's own grader (SWE-bench's harness in the adapter's
  ``run-tests.sh``) prints its verdict between ``SWEBench results starts here`` and
  ``SWEBench results ends here`` (``SWE-Perf results …`` for sweperf): ``PASSED`` is resolved,
  any other block is not. Without both markers there is no verdict (the grader never ran, e.g. the
  repository could not be fetched), which terminal-bench treats as an error, not a failure.
- ``mlebench``: ``ALL TESTS PASSED`` between ``MLEBench results starts here`` and
  ``MLEBench results ends here`` (a missing marker widens the block to the start or the end of
  the output, as in terminal-bench).
- ``swelancer``: ``SWE LANCER SUCCESS`` or ``SWE LANCER FAILURE`` (any case). terminal-bench also
  passes output that mentions ``user_tool`` and ``completed`` without either line; that fallback
  is not followed here (anything an agent writes can contain those words): no line, no verdict.

Every grader returns a :class:`TestSummary` (``None``: no verdict in the output).
"""

from __future__ import annotations

from collections.abc import Callable

from miles_env_terminal_bench.parser import TestSummary, parse_pytest_output, plain_text

SWEBENCH_LABEL = "SWEBench"
SWEPERF_LABEL = "SWE-Perf"
MLEBENCH_LABEL = "MLEBench"
SWELANCER_SUCCESS = "swe lancer success"
SWELANCER_FAILURE = "swe lancer failure"


def _markers(label: str) -> tuple[str, str]:
    return f"{label} results starts here", f"{label} results ends here"


def _verdict(name: str, passed: bool, source: str) -> TestSummary:
    return TestSummary(int(passed), int(not passed), source, {name: "PASSED" if passed else "FAILED"})


def _between_markers(label: str) -> Callable[[str], TestSummary | None]:
    start, end = _markers(label)

    def parse(text: str) -> TestSummary | None:
        if start not in text or end not in text:
            return None
        block = text.split(start, 1)[1].rsplit(end, 1)[0].strip()
        return _verdict("tests", block == "PASSED", f"{label} markers")

    return parse


def parse_mlebench_output(text: str) -> TestSummary | None:
    start, end = _markers(MLEBENCH_LABEL)
    block = text.split(start, 1)[-1].rsplit(end, 1)[0].strip()
    return _verdict("tests", block == "ALL TESTS PASSED", f"{MLEBENCH_LABEL} markers")


def parse_swelancer_output(text: str) -> TestSummary | None:
    lowered = text.lower()
    if SWELANCER_SUCCESS in lowered:
        return _verdict("swelancer_task", True, "SWE LANCER line")
    if SWELANCER_FAILURE in lowered:
        return _verdict("swelancer_task", False, "SWE LANCER line")
    return None


GRADERS: dict[str, Callable[[str], TestSummary | None]] = {
    "pytest": parse_pytest_output,
    "swebench": _between_markers(SWEBENCH_LABEL),
    "sweperf": _between_markers(SWEPERF_LABEL),
    "mlebench": parse_mlebench_output,
    "swelancer": parse_swelancer_output,
}

# what each grader looks for, for the error when the output has none of it
EXPECTED: dict[str, str] = {
    "pytest": "no pytest 'short test summary info' section and no final 'N passed, M failed' line",
    "swebench": "no verdict between '{}' and '{}'".format(*_markers(SWEBENCH_LABEL)),
    "sweperf": "no verdict between '{}' and '{}'".format(*_markers(SWEPERF_LABEL)),
    "swelancer": "no 'SWE LANCER SUCCESS' or 'SWE LANCER FAILURE' line",
}


def grade(parser_name: str, text: str) -> TestSummary | None:
    """The verdict of ``parser_name`` (one of :data:`GRADERS`) on ``text``."""
    return GRADERS[parser_name](plain_text(text))


def expected(parser_name: str) -> str:
    return EXPECTED.get(parser_name, "no verdict")

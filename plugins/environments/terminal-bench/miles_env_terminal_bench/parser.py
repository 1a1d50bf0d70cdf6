"""Grade pytest's console output the way terminal-bench's ``PytestParser`` does.

Primary source: the ``short test summary info`` section (``pytest -rA`` lists every test
there), one ``STATUS test-id[ - message]`` line per test. As in terminal-bench, PASSED, XFAIL
and SKIPPED count as passed; FAILED, ERROR and XPASS as failed. Fallback: pytest's final line
(``== 3 passed, 1 failed in 0.12s ==``), summed over every pytest run in the output; it is
also used when the short summary lists fewer tests than the final line counts (pytest run
without ``-rA`` lists failures only). Output with neither is unparseable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PASS_STATUSES = frozenset({"PASSED", "XFAIL", "SKIPPED"})
FAIL_STATUSES = frozenset({"FAILED", "ERROR", "XPASS"})
_FINAL_PASS = {"passed", "xfailed", "skipped"}
_FINAL_FAIL = {"failed", "error", "errors", "xpassed"}

_HEADER = re.compile(r"=+\s*short test summary info\s*=+", re.IGNORECASE)
_COUNT = re.compile(r"(\d+) ([a-z]+)")
_FINAL = re.compile(
    r"^=*\s*(?P<body>(?:\d+ [a-z]+)(?:, \d+ [a-z]+)*|no tests ran)(?: in [\d.]+s(?: \([^)]*\))?)\s*=*\s*$"
)
_SKIP_COUNT = re.compile(r"^\[(\d+)\]")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class TestSummary:
    """A test run's tally as a grader read it (every terminal-bench parser gives one)."""

    __test__ = False  # not a pytest test class
    passed: int
    failed: int
    source: str  # what it was read from: "short-summary", "final-line", "SWEBench markers", …
    tests: dict[str, str] = field(default_factory=dict)  # test id -> status (where the output names tests)

    @property
    def total(self) -> int:
        return self.passed + self.failed

    @property
    def pass_fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def resolved(self) -> bool:
        """terminal-bench's verdict, plus: at least one test must have run."""
        return self.failed == 0 and self.passed >= 1


def _short_summary(text: str) -> tuple[dict[str, str], int, int] | None:
    parts = _HEADER.split(text, maxsplit=1)
    if len(parts) < 2:
        return None
    tests: dict[str, str] = {}
    counts: dict[str, int] = {}
    for raw in parts[1].splitlines():
        line = raw.strip()
        status, _, rest = line.partition(" ")
        if status not in PASS_STATUSES and status not in FAIL_STATUSES or not rest:
            continue
        weight = 1
        if status == "SKIPPED" and (m := _SKIP_COUNT.match(rest)):
            weight = int(m.group(1))
        elif status != "SKIPPED":
            rest = rest.split(" - ", 1)[0]
        name = rest.strip()
        if name in tests:  # the same test reported twice (re-runs): the last report wins
            counts[name] = 0
        tests[name] = status
        counts[name] = weight
    passed = sum(counts[n] for n, s in tests.items() if s in PASS_STATUSES)
    failed = sum(counts[n] for n, s in tests.items() if s in FAIL_STATUSES)
    return tests, passed, failed


def _final_lines(text: str) -> tuple[int, int] | None:
    found = False
    passed = failed = 0
    for raw in text.splitlines():
        m = _FINAL.match(raw.strip())
        if not m:
            continue
        found = True
        for number, word in _COUNT.findall(m.group("body")):
            if word in _FINAL_PASS:
                passed += int(number)
            elif word in _FINAL_FAIL:
                failed += int(number)
    return (passed, failed) if found else None


PytestSummary = TestSummary  # the name this module first gave it


def plain_text(text: str) -> str:
    """Terminal output without colour codes and with ``\\n`` line ends."""
    return _ANSI.sub("", text).replace("\r\n", "\n")


def parse_pytest_output(text: str) -> TestSummary | None:
    """The test tally of pytest's console output, or ``None`` when there is none."""
    text = plain_text(text)
    short = _short_summary(text)
    final = _final_lines(text)
    if short is not None and short[0]:
        tests, passed, failed = short
        if final is None or sum(final) <= passed + failed:
            return TestSummary(passed, failed, "short-summary", tests)
    if final is not None:
        return TestSummary(final[0], final[1], "final-line")
    return None

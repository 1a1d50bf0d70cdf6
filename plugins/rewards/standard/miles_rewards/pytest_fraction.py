"""``pytest``: the fraction of tests that passed, from the run's JUnit XML or its summary line.

The command runs in the episode's sandbox and must write JUnit XML to ``junit_path`` (the default
command does: ``python3 -m pytest -q -p no:cacheprovider --junitxml=<junit_path> <tests>``). When
no report exists the last pytest summary line of the output is parsed instead (``== 3 passed, 1
failed, 2 errors in 0.12s ==``). ``reward = passed / counted`` where ``counted`` is passed + failed
+ errors (+ skipped when ``count_skipped``); xfail/xpass follow pytest (xfailed counts as a skip,
xpassed as a pass). No tests collected, an unreadable report and a timed-out run are errors.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from pydantic import Field

from miles_engine.components import Section
from miles_engine.environments.protocol import EpisodeContext, RewardResult
from miles_engine.rewards.protocol import describe_error

MAX_REPORT_BYTES = 8 << 20


class PytestOptions(Section):
    tests: str = Field("/tests", description="test path(s) handed to pytest by the default command")
    command: str | None = Field(None, description="run this instead; it must write JUnit XML to junit_path "
                                                  "or print pytest's summary line")
    tests_dir: str | None = Field(None, description="host directory uploaded to tests_target before the run")
    tests_target: str = "/tests"
    junit_path: str = Field("/tmp/miles-pytest-junit.xml", description="where the run writes its JUnit XML")
    python: str = Field("python3", description="interpreter of the default command")
    count_skipped: bool = Field(False, description="count skipped tests as not passed")
    timeout_s: float = Field(600.0, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None


@dataclass(frozen=True)
class PytestCounts:
    passed: int
    failed: int
    errors: int
    skipped: int

    def fraction(self, count_skipped: bool) -> float | None:
        counted = self.passed + self.failed + self.errors + (self.skipped if count_skipped else 0)
        return self.passed / counted if counted else None

    def as_components(self) -> dict[str, float]:
        return {"passed": float(self.passed), "failed": float(self.failed), "errors": float(self.errors),
                "skipped": float(self.skipped)}


class ReportError(ValueError):
    """A report that cannot be read as pytest's output."""


def parse_junit(data: bytes) -> PytestCounts:
    """Counts from a JUnit XML report (``<testsuites>`` or one ``<testsuite>``), per test case."""
    try:
        root = ElementTree.fromstring(data)
    except ElementTree.ParseError as exc:
        raise ReportError(f"not valid XML: {exc}") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise ReportError(f"root element is <{root.tag}>, not <testsuites> or <testsuite>")
    passed = failed = errors = skipped = 0
    for case in root.iter("testcase"):
        outcome = {child.tag for child in case}
        if "error" in outcome:
            errors += 1
        elif "failure" in outcome:
            failed += 1
        elif "skipped" in outcome:
            skipped += 1
        else:
            passed += 1
    if not any(root.iter("testcase")):  # collection errors leave suite-level counts only
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        errors = sum(_int_attr(s, "errors") for s in suites)
        failed = sum(_int_attr(s, "failures") for s in suites)
    return PytestCounts(passed, failed, errors, skipped)


def _int_attr(element: Any, name: str) -> int:
    try:
        return max(int(element.get(name, 0)), 0)
    except (TypeError, ValueError):
        return 0


# one summary line: "==== 3 passed, 1 failed, 2 errors in 0.12s ====" (or -q's bare "3 passed in 0.12s");
# letters-only words keep the pattern linear on hostile output
_SUMMARY = re.compile(r"^=*\s*((?:\d+ [a-z]+(?:, )?)+) in [\d.]+\s*s(?:econds)?\b")
_PAIR = re.compile(r"(\d+) ([a-z]+)")
MAX_SUMMARY_LINE = 400


def parse_summary(output: str) -> PytestCounts:
    """Counts from the last summary line pytest prints (``-q`` or not)."""
    for line in reversed(output[-200_000:].splitlines()):
        line = line.strip()
        if len(line) > MAX_SUMMARY_LINE:
            continue
        if line.strip("= ").startswith("no tests ran"):
            return PytestCounts(0, 0, 0, 0)
        m = _SUMMARY.match(line)
        if m is None:
            continue
        counts = {word: int(n) for n, word in _PAIR.findall(m.group(1))}
        return PytestCounts(passed=counts.get("passed", 0) + counts.get("xpassed", 0),
                            failed=counts.get("failed", 0),
                            errors=counts.get("error", 0) + counts.get("errors", 0),
                            skipped=counts.get("skipped", 0) + counts.get("xfailed", 0))
    raise ReportError("no pytest summary line ('N passed, M failed in Xs') in the output")


class PytestFraction:
    deterministic = True  # as deterministic as the tests it runs

    def __init__(self, options: PytestOptions) -> None:
        self.options = options
        if options.tests_dir is not None and not Path(options.tests_dir).is_dir():
            from miles_engine.errors import ConfigError

            raise ConfigError(f"pytest reward: tests_dir '{options.tests_dir}' is not a directory")

    def command(self) -> str:
        o = self.options
        if o.command is not None:
            return o.command
        return (f"{shlex.quote(o.python)} -m pytest -q -p no:cacheprovider "
                f"--junitxml={shlex.quote(o.junit_path)} {o.tests}")

    async def score(self, episode: EpisodeContext) -> RewardResult:
        where = f"task '{getattr(getattr(episode, 'task', None), 'id', '?')}'"
        if getattr(episode, "sandbox", None) is None:
            return RewardResult.failed(f"{where}: the pytest reward needs the episode's sandbox; it has none")
        try:
            return await self._run(episode, where)
        except Exception as exc:  # noqa: BLE001 - a sandbox failure is this episode's error
            return RewardResult.failed(f"{where}: the pytest reward could not run: {describe_error(exc)}")

    async def _run(self, episode: EpisodeContext, where: str) -> RewardResult:
        o, sandbox = self.options, episode.sandbox
        assert sandbox is not None
        await sandbox.exec(f"rm -f {shlex.quote(o.junit_path)}", timeout_s=30)
        if o.tests_dir is not None:
            await sandbox.exec(f"mkdir -p {shlex.quote(o.tests_target)}", timeout_s=30)
            await sandbox.upload_dir(Path(o.tests_dir), o.tests_target)
        command = f"cd {shlex.quote(o.workdir)} && {self.command()}" if o.workdir else self.command()
        run = await sandbox.exec(command, env=o.env or None, timeout_s=o.timeout_s)
        output = run.stdout + run.stderr
        info: dict[str, Any] = {"exit_code": run.exit_code, "output_tail": output[-2000:]}
        if run.timed_out:
            return RewardResult.failed(f"{where}: the pytest run timed out after {o.timeout_s:g}s", **info)
        exists = await sandbox.exec(f"test -f {shlex.quote(o.junit_path)}", timeout_s=30)
        try:
            if exists.ok:
                counts = parse_junit(await sandbox.read_file(o.junit_path, max_bytes=MAX_REPORT_BYTES))
                info["report"] = o.junit_path
            else:
                counts = parse_summary(output)
                info["report"] = "summary line"
        except ReportError as exc:
            source = o.junit_path if exists.ok else "the run's output"
            return RewardResult.failed(f"{where}: cannot read pytest results from {source}: {exc}", **info)
        fraction = counts.fraction(o.count_skipped)
        if fraction is None:
            return RewardResult.failed(f"{where}: pytest ran no tests (exit code {run.exit_code})",
                                       **info, **counts.as_components())
        return RewardResult(reward=fraction, components=counts.as_components(), info=info)

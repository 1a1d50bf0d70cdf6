"""The readiness check's Docker-HEALTHCHECK timing, on a scripted sandbox and a virtual clock
(every sleep advances the clock; nothing waits in real time)."""

from __future__ import annotations

import asyncio

import pytest

from miles_engine.errors import HealthcheckError, SandboxError
from miles_engine.sandbox.healthcheck import Healthcheck, wait_healthy
from miles_engine.sandbox.protocol import ExecResult


class ScriptedSandbox:
    """Answers each exec with the next of ``results``; records the calls."""

    def __init__(self, results: list[ExecResult]) -> None:
        self.results = list(results)
        self.calls: list[tuple[str, float | None, str | None]] = []

    async def exec(self, cmd, *, timeout_s=None, user=None, **_):
        self.calls.append((cmd, timeout_s, user))
        return self.results.pop(0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


FAIL = ExecResult(exit_code=7, stdout="connection refused\n", stderr="")
PASS = ExecResult(exit_code=0, stdout="", stderr="")


def wait(sb, check, clock, **kw):
    return asyncio.run(wait_healthy(sb, check, sleep=clock.sleep, clock=clock, **kw))


def test_harbor_defaults():
    check = Healthcheck(command="true")
    assert (check.interval_s, check.timeout_s, check.start_period_s, check.start_interval_s, check.retries) == \
        (5.0, 30.0, 0.0, 5.0, 3)


def test_passes_after_failures_within_the_retries():
    sb, clock = ScriptedSandbox([FAIL, FAIL, PASS]), Clock()
    outcome = wait(sb, Healthcheck(command="curl -f http://localhost", interval_s=2, timeout_s=4), clock)
    assert outcome.tries == 3 and clock.sleeps == [2, 2]
    assert sb.calls == [("curl -f http://localhost", 4, None)] * 3  # each try bounded by timeout_s


def test_fails_on_the_retries_th_consecutive_failure_naming_the_command_and_its_last_output():
    sb, clock = ScriptedSandbox([FAIL, FAIL, ExecResult(exit_code=1, stdout="", stderr="still down")]), Clock()
    with pytest.raises(HealthcheckError) as exc:
        wait(sb, Healthcheck(command="probe", interval_s=1, retries=3), clock, where="task 't'")
    msg = str(exc.value)
    assert msg.startswith("task 't': healthcheck did not pass: `probe` failed 3 consecutive time(s)")
    assert "exit code 1; its last output: still down" in msg
    assert isinstance(exc.value, SandboxError) and len(sb.calls) == 3 and clock.sleeps == [1, 1]


def test_failures_in_the_start_period_do_not_count():
    # start period 10s, start interval 4s: tries at t=0, 4, 8 fall in it; t=12 and t=13 count
    sb, clock = ScriptedSandbox([FAIL, FAIL, FAIL, FAIL, FAIL]), Clock()
    with pytest.raises(HealthcheckError, match=r"failed 2 consecutive time\(s\) after a 10s start period \(5 tries"):
        wait(sb, Healthcheck(command="probe", interval_s=1, start_period_s=10, start_interval_s=4, retries=2), clock)
    assert clock.sleeps == [4, 4, 4, 1]


def test_a_timed_out_try_is_a_failure_and_says_so():
    sb, clock = ScriptedSandbox([ExecResult(exit_code=None, stdout="", stderr="", timed_out=True)]), Clock()
    with pytest.raises(HealthcheckError, match=r"timed out after 2s; it printed nothing"):
        wait(sb, Healthcheck(command="sleep 9", timeout_s=2, retries=1), clock)


def test_runs_as_the_given_user():
    sb, clock = ScriptedSandbox([PASS]), Clock()
    wait(sb, Healthcheck(command="true"), clock, user="agent")
    assert sb.calls == [("true", 30.0, "agent")]


@pytest.mark.parametrize("bad", [{"command": ""}, {"command": "x", "retries": 0}, {"command": "x", "timeout_s": 0}])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError):
        Healthcheck(**bad)

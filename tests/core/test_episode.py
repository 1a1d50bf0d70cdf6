"""The episode runner turns every task/agent failure into a failed sample, never a crash."""

from __future__ import annotations

import asyncio

import pytest

from miles_engine.agents.builtin import NopAgent, OracleAgent
from miles_engine.errors import SandboxUnsupportedError
from miles_engine.rollout.episode import run_episode
from miles_engine.sandbox.protocol import SandboxSpec

from .fakes import FileTask, MemoryBackend


def run(task, agent, backend=None):
    backend = backend or MemoryBackend()
    result = asyncio.run(run_episode(task, agent, backend))
    assert all(sb.closed >= 1 for sb in backend.created), "sandbox must always be closed"
    return result


def test_oracle_scores_one_and_records_transcript():
    result = run(FileTask(), OracleAgent())
    assert result.reward.reward == 1.0 and result.ok
    roles = [m["role"] for m in result.transcript]
    assert roles == ["assistant", "tool"]
    assert result.transcript[0]["tool_calls"][0]["function"]["name"] == "bash"
    assert set(result.timings) >= {"create_s", "setup_s", "agent_s", "verify_s", "teardown_s"}


def test_nop_scores_zero():
    assert run(FileTask(), NopAgent()).reward.reward == 0.0


@pytest.mark.parametrize(
    ("fail", "needle"),
    [("setup", "setup of task 't' failed: RuntimeError: setup exploded"),
     ("verify", "verifier of task 't' failed: ValueError: garbage reward"),
     ("verify-timeout", "verifier of task 't' timed out after 1s")],
)
def test_failures_become_failed_rewards(fail, needle):
    result = run(FileTask(fail=fail), OracleAgent())
    assert result.reward.reward is None and needle in (result.reward.error or "")


def test_agent_timeout_is_recorded_and_still_verified():
    result = run(FileTask(fail="agent-timeout"), OracleAgent())
    assert result.agent.stop_reason == "timeout"
    assert result.reward.reward == 0.0 and result.reward.error is None


def test_teardown_error_does_not_hide_the_reward():
    assert run(FileTask(fail="teardown"), OracleAgent()).reward.reward == 1.0


def test_unsupported_spec_is_refused_before_running():
    task = FileTask(spec=SandboxSpec(image="ubuntu:24.04"))
    with pytest.raises(SandboxUnsupportedError, match="container image 'ubuntu:24.04'"):
        asyncio.run(run_episode(task, OracleAgent(), MemoryBackend()))


def test_sandbox_less_task_runs_without_backend():
    result = asyncio.run(run_episode(FileTask(spec=None), NopAgent(), None))
    assert result.reward.error and "AssertionError" in result.reward.error


def test_non_finite_reward_is_rejected():
    from pydantic import ValidationError

    from miles_engine.environments.protocol import RewardResult

    with pytest.raises(ValidationError, match="finite"):
        RewardResult(reward=float("nan"))

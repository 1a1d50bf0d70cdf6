"""Model-free self-check of an environment: the reference solution must score 1.0, doing nothing 0.0."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from miles_engine.environments.protocol import EnvironmentSource
from miles_engine.hub import Hub
from miles_engine.rollout.episode import EpisodeResult, run_episode
from miles_engine.sandbox.protocol import SandboxBackend


@dataclass
class TaskCheck:
    task_id: str
    oracle: float | None
    nop: float | None
    problems: list[str]
    seconds: float

    @property
    def passed(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task_id,
            "passed": self.passed,
            "oracle_reward": self.oracle,
            "nop_reward": self.nop,
            "problems": self.problems,
            "seconds": round(self.seconds, 3),
        }


def _verdict(label: str, expected: float, result: EpisodeResult | BaseException) -> tuple[float | None, str | None]:
    if isinstance(result, BaseException):
        return None, f"{label}: {type(result).__name__}: {result}"
    if result.reward.error:
        return None, f"{label}: {result.reward.error}"
    value = result.reward.reward
    if value != expected:
        return value, f"{label} scored {value} (expected {expected})" + _evidence(result)
    return value, None


def _evidence(result: EpisodeResult) -> str:
    """What the solution and the verifier printed, so a wrong score can be read without a rerun."""
    parts = [] if result.agent.stop_reason == "done" else [f"agent stop reason {result.agent.stop_reason!r}"]
    solution = result.info.get("solution")
    if isinstance(solution, dict):
        parts.append(f"solution exit code {solution.get('exit_code')}"
                     + (" (timed out)" if solution.get("timed_out") else "")
                     + f", output tail {str(solution.get('output_tail', '')).strip()[-400:]!r}")
    tail = result.reward.info.get("test_stdout_tail")
    if tail:
        parts.append(f"verifier output tail {str(tail).strip()[-400:]!r}")
    return "".join(f"; {p}" for p in parts)


async def _check_task(source: EnvironmentSource, task_id: str, backend: SandboxBackend, hub: Hub) -> TaskCheck:
    started = time.perf_counter()
    runs: dict[str, EpisodeResult | BaseException] = {}
    for label, agent in (("oracle", "oracle"), ("nop", "nop")):
        try:
            task = source.load_task(task_id)  # a fresh task object per attempt
            runs[label] = await run_episode(task, hub.create("agent", agent), backend)
        except Exception as exc:  # one broken task must not stop the check of the others
            runs[label] = exc
    oracle, p1 = _verdict("oracle", 1.0, runs["oracle"])
    nop, p2 = _verdict("no-op", 0.0, runs["nop"])
    problems = [p for p in (p1, p2) if p]
    return TaskCheck(task_id, oracle, nop, problems, time.perf_counter() - started)


async def validate_environment(
    source: EnvironmentSource,
    backend: SandboxBackend,
    *,
    hub: Hub,
    task_ids: Sequence[str] | None = None,
    jobs: int = 4,
    on_result: Callable[[TaskCheck], None] | None = None,
) -> list[TaskCheck]:
    """Check every task (or ``task_ids``) with at most ``jobs`` tasks in flight; the oracle and
    no-op agents are the hub's (``oracle``, ``nop``)."""
    ids = list(task_ids) if task_ids is not None else [ref.id for ref in source.list_tasks()]
    gate = asyncio.Semaphore(max(1, jobs))

    async def one(task_id: str) -> TaskCheck:
        async with gate:
            check = await _check_task(source, task_id, backend, hub)
        if on_result is not None:
            on_result(check)
        return check

    return list(await asyncio.gather(*(one(t) for t in ids)))

"""Run one episode: sandbox → setup → agent (bounded) → verify (bounded) → teardown → close.

Nothing here raises for a task's or agent's failure: every failure lands in
:class:`EpisodeResult.reward` as ``RewardResult.failed(...)`` so a batch never crashes.
Only a refused sandbox (the backend cannot isolate the task as asked) is raised, because
running it anyway would be under-isolated and retrying cannot help.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from miles_engine.agents.protocol import Agent, AgentResult
from miles_engine.environments.protocol import EpisodeContext, Message, NoReferenceSolution, RewardResult, Task
from miles_engine.errors import SandboxUnsupportedError
from miles_engine.rewards.protocol import RewardFunction
from miles_engine.rollout.commands import CommandLog, RecordingSandbox
from miles_engine.sandbox.protocol import SandboxBackend


@dataclass
class EpisodeResult:
    task_id: str
    reward: RewardResult
    agent: AgentResult
    transcript: list[Message] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    isolation: str | None = None
    # what the task and agent left in the episode context (e.g. TITO trajectories), kept
    # even when the agent timed out
    info: dict[str, Any] = field(default_factory=dict)
    # the verifier (the task's or the recipe's reward stack) ran and gave no usable reward, as
    # opposed to an episode that failed before it could be verified (setup, no solution)
    reward_error: bool = False

    @property
    def ok(self) -> bool:
        return self.reward.error is None and self.reward.reward is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "reward": self.reward.reward,
            "components": self.reward.components,
            "error": self.reward.error,
            "agent_stop_reason": self.agent.stop_reason,
            "turns": self.agent.turns,
            "timings": self.timings,
            "isolation": self.isolation,
        }


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def run_episode(task: Task, agent: Agent, backend: SandboxBackend | None, *,
                      reward: RewardFunction | None = None) -> EpisodeResult:
    """Run ``agent`` on ``task`` in a fresh sandbox from ``backend`` (``None`` for sandbox-less tasks),
    scored by ``reward`` (a recipe's reward stack) or, when ``None``, by the task's own verifier."""
    timings: dict[str, float] = {}
    spec = task.sandbox_spec()
    if spec is not None and backend is None:
        raise SandboxUnsupportedError(f"task '{task.id}' needs a sandbox but no sandbox backend was given")
    started = time.perf_counter()
    commands = CommandLog()
    sandbox = await backend.create(spec) if spec is not None and backend is not None else None
    timings["create_s"] = time.perf_counter() - started
    ctx = EpisodeContext(task=task, sandbox=RecordingSandbox(sandbox, commands) if sandbox is not None else None)
    if backend is not None:  # tasks needing a second sandbox (Harbor's separate verifier) create and close it
        ctx.info["sandbox_factory"] = backend.create
    agent_result = AgentResult(stop_reason="not_started")
    verdict: RewardResult
    verified = False
    try:
        verdict, verified = await _drive(task, agent, ctx, timings, reward, commands)
        agent_result = ctx.info.pop("agent_result", agent_result)
    finally:
        t0 = time.perf_counter()
        commands.phase = "teardown"
        try:
            await asyncio.shield(task.teardown(ctx))
        except Exception as exc:  # teardown must not hide the verdict, but is reported
            ctx.info["teardown_error"] = _describe(exc)
        if sandbox is not None:
            await asyncio.shield(sandbox.close())
        timings["teardown_s"] = time.perf_counter() - t0
    isolation = getattr(sandbox, "isolation", None)
    info = {k: v for k, v in ctx.info.items() if k != "sandbox_factory"}
    info["commands"] = commands.commands
    return EpisodeResult(task.id, verdict, agent_result, ctx.transcript, timings, isolation, info,
                         reward_error=verified and verdict.reward is None)


async def _drive(task: Task, agent: Agent, ctx: EpisodeContext, timings: dict[str, float],
                 scorer: RewardFunction | None, commands: CommandLog) -> tuple[RewardResult, bool]:
    """The verdict, and whether the verifier ran (``False``: the episode failed before it)."""
    t0 = time.perf_counter()
    try:
        await task.setup(ctx)
    except Exception as exc:
        return RewardResult.failed(f"setup of task '{task.id}' failed: {_describe(exc)}"), False
    t1 = time.perf_counter()
    timings["setup_s"] = t1 - t0
    commands.phase = "agent"
    try:
        result = await asyncio.wait_for(agent.run(ctx), timeout=task.limits.agent_timeout_s)
    except asyncio.TimeoutError:
        result = AgentResult(stop_reason="timeout")
    except NoReferenceSolution as exc:
        return RewardResult.failed(str(exc)), False
    except Exception as exc:
        result = AgentResult(stop_reason="error", info={"error": _describe(exc)})
    ctx.info["agent_result"] = result
    t2 = time.perf_counter()
    timings["agent_s"] = t2 - t1
    commands.phase = "verify"
    try:
        scoring = scorer.score(ctx) if scorer is not None else task.verify(ctx)
        reward = await asyncio.wait_for(scoring, timeout=task.limits.verifier_timeout_s)
        if not isinstance(reward, RewardResult):
            reward = RewardResult.failed(f"verifier of task '{task.id}' returned {type(reward).__name__}, "
                                         f"not a RewardResult")
    except asyncio.TimeoutError:
        reward = RewardResult.failed(
            f"verifier of task '{task.id}' timed out after {task.limits.verifier_timeout_s:g}s"
        )
    except Exception as exc:
        reward = RewardResult.failed(f"verifier of task '{task.id}' failed: {_describe(exc)}")
    timings["verify_s"] = time.perf_counter() - t2
    return reward, True

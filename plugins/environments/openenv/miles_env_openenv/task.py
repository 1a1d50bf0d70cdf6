"""One OpenEnv episode as a miles task: reset on setup, one tool that steps, reward from observations.

The agent sees the environment's action schema as one tool (default ``step``); each call sends
the arguments as the action and returns the observation (JSON), the step's reward and ``done``.
After ``done`` further calls are refused. ``prompt()`` before setup is the instruction; after
setup it also holds the reset observation (the runner sets up before the agent reads it).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Literal

from miles_engine.environments.protocol import (
    EpisodeContext,
    Message,
    NoReferenceSolution,
    RewardResult,
    TaskLimits,
    ToolResult,
    ToolSpec,
)
from miles_engine.sandbox.protocol import SandboxSpec

from miles_env_openenv.server import OpenEnvServerError, ws_url
from miles_env_openenv.target import Target
from miles_env_openenv.wire import OpenEnvActionError, OpenEnvSession, StepReply

RewardMode = Literal["sum", "last"]
UnfinishedPolicy = Literal["score", "zero", "fail"]


def format_observation(reply: StepReply) -> str:
    text = json.dumps(reply.observation, ensure_ascii=False, default=str)
    tail = [f"reward: {reply.reward:g}" if reply.reward is not None else "reward: none"]
    if reply.done:
        tail.append("done: the episode is over")
    return text + "\n" + "\n".join(tail)


class OpenEnvTask:
    def __init__(self, task_id: str, target: Target, *, seed: int, instruction: str, limits: TaskLimits,
                 reset_kwargs: dict[str, Any], reward_mode: RewardMode, unfinished: UnfinishedPolicy,
                 connect_timeout_s: float, message_timeout_s: float, capacity_wait_s: float,
                 max_message_bytes: int) -> None:
        self.id = task_id
        self.target = target
        self.seed = seed
        self.instruction = instruction
        self.limits = limits
        self.metadata: dict[str, Any] = {"environment": target.name, "seed": seed}
        self.reset_kwargs = dict(reset_kwargs)
        self.reward_mode = reward_mode
        self.unfinished = unfinished
        self.connect_timeout_s = connect_timeout_s
        self.message_timeout_s = message_timeout_s
        self.capacity_wait_s = capacity_wait_s
        self.max_message_bytes = max_message_bytes
        self._session: OpenEnvSession | None = None
        self._initial: StepReply | None = None
        self._rewards: list[float | None] = []
        self._done = False
        self._broken: str | None = None  # why the session can no longer be used

    # ------------------------------------------------------------------ what the agent sees
    def prompt(self) -> list[Message]:
        text = self.instruction
        if self._initial is not None:
            text += "\n\nInitial observation:\n" + format_observation(self._initial)
        return [{"role": "user", "content": text}]

    def sandbox_spec(self) -> SandboxSpec | None:
        return None

    def tools(self) -> list[ToolSpec]:
        return [self.target.tool()]

    # ------------------------------------------------------------------ episode
    async def setup(self, ctx: EpisodeContext) -> None:
        await asyncio.to_thread(self.target.tool)  # starts a served app; fetches /schema once
        base = self.target.base_url()
        session = OpenEnvSession(ws_url(base), message_timeout_s=self.message_timeout_s,
                                 max_message_bytes=self.max_message_bytes)
        reset = {"seed": self.seed, "episode_id": f"{self.id}-{uuid.uuid4().hex[:12]}", **self.reset_kwargs}
        self._session = session
        self._initial = await session.open(reset, connect_timeout_s=self.connect_timeout_s,
                                           capacity_wait_s=self.capacity_wait_s)
        self._done = self._initial.done
        ctx.info["openenv"] = {"url": session.url, "episode_id": reset["episode_id"], "seed": self.seed}

    async def call_tool(self, ctx: EpisodeContext, name: str, arguments: dict[str, Any]) -> ToolResult:
        if name != self.target.tool_name:
            return ToolResult(f"error: unknown tool '{name}'; available tools: {self.target.tool_name}", is_error=True)
        if self._broken:
            return ToolResult(f"error: the environment session is lost ({self._broken})", is_error=True)
        if self._done:
            return ToolResult("error: the episode is over; no more actions are accepted", is_error=True)
        if self._session is None:
            return ToolResult("error: the episode was not set up", is_error=True)
        try:
            reply = await self._session.step(arguments)
        except OpenEnvActionError as exc:
            return ToolResult(f"error: the environment refused the action: {exc}", is_error=True)
        except OpenEnvServerError as exc:
            self._broken = str(exc)
            return ToolResult(f"error: {exc}", is_error=True)
        self._rewards.append(reply.reward)
        self._done = reply.done
        return ToolResult(format_observation(reply))

    async def solve(self, ctx: EpisodeContext) -> None:
        raise NoReferenceSolution(f"task '{self.id}': OpenEnv environments have no reference solution")

    async def verify(self, ctx: EpisodeContext) -> RewardResult:
        info: dict[str, Any] = {"steps": len(self._rewards), "done": self._done,
                                "step_rewards": list(self._rewards)}
        if self._broken:
            return RewardResult(reward=None, error=self._broken, info=info)
        if self._session is None:
            return RewardResult(reward=None, error=f"task '{self.id}' was not set up", info=info)
        try:
            info["state"] = await self._session.state()
        except OpenEnvServerError as exc:
            return RewardResult(reward=None, error=str(exc), info=info)
        if not self._done:
            if self.unfinished == "fail":
                return RewardResult(reward=None, info=info, error=(
                    f"the episode did not reach done after {len(self._rewards)} step(s)"))
            if self.unfinished == "zero":
                return RewardResult(reward=0.0, info=info)
        observed = [r for r in self._rewards if r is not None]
        if self.reward_mode == "sum":
            reward = float(sum(observed))
        else:
            reward = self._rewards[-1] if self._rewards and self._rewards[-1] is not None else 0.0
        return RewardResult(reward=reward, info=info)

    async def teardown(self, ctx: EpisodeContext) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

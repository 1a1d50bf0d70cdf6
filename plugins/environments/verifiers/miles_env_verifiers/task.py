"""One verifiers task as a miles task: its prompt, its toolsets as tools, its rewards as the verifier."""

from __future__ import annotations

from typing import Any

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

from miles_env_verifiers.messages import prompt_messages
from miles_env_verifiers.scoring import score_episode
from miles_env_verifiers.toolsets import BoundTool, bind_tools


class VerifiersTask:
    def __init__(self, task_id: str, vf_task: Any, toolsets: list[Any], *, limits: TaskLimits) -> None:
        self.id = task_id
        self.vf_task = vf_task
        self.toolsets = toolsets
        self.limits = limits
        data = vf_task.data
        self.metadata: dict[str, Any] = {"verifiers_task": type(vf_task).__name__, "idx": data.idx,
                                         "name": data.name, "key": vf_task.key}
        self._tools: dict[str, BoundTool] = bind_tools(toolsets, task_id)

    def prompt(self) -> list[Message]:
        return prompt_messages(self.vf_task.data)

    def sandbox_spec(self) -> SandboxSpec | None:
        return None

    def tools(self) -> list[ToolSpec]:
        return [t.spec for t in self._tools.values()]

    async def setup(self, ctx: EpisodeContext) -> None:
        for toolset in self.toolsets:
            await toolset.setup()
            await toolset.setup_task(self.vf_task)

    async def call_tool(self, ctx: EpisodeContext, name: str, arguments: dict[str, Any]) -> ToolResult:
        tool = self._tools.get(name)
        if tool is None:
            known = ", ".join(self._tools) or "none"
            return ToolResult(f"error: unknown tool '{name}'; available tools: {known}", is_error=True)
        content, is_error = await tool.call(arguments)
        return ToolResult(content, is_error=is_error)

    async def solve(self, ctx: EpisodeContext) -> None:
        raise NoReferenceSolution(f"task '{self.id}': verifiers tasks carry no reference solution for the oracle")

    async def verify(self, ctx: EpisodeContext) -> RewardResult:
        sampled = [{**m, "_sampled": m.get("role") == "assistant"} for m in ctx.transcript]
        tools = [t.model_dump() for t in self.tools()]
        return await score_episode(self.vf_task, [*self.prompt(), *sampled], tools)

    async def teardown(self, ctx: EpisodeContext) -> None:
        return None  # toolsets run in-process and hold nothing per episode beyond this task object

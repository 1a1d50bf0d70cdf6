"""Shared behaviour for tasks whose tools run in a sandbox (default: one ``bash`` tool)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from miles_engine.environments.protocol import (
    BASH_TOOL,
    EpisodeContext,
    Message,
    NoReferenceSolution,
    RewardResult,
    TaskLimits,
    ToolResult,
    ToolSpec,
    format_exec_observation,
)
from miles_engine.sandbox.protocol import SandboxSpec


class SandboxTask(ABC):
    """Base for tasks with a sandbox and a ``bash`` tool. Subclasses add verify/solve."""

    def __init__(self, task_id: str, *, limits: TaskLimits | None = None, metadata: dict[str, Any] | None = None):
        self.id = task_id
        self.limits = limits or TaskLimits()
        self.metadata = dict(metadata or {})

    @abstractmethod
    def prompt(self) -> list[Message]:
        """The opening messages shown to the agent."""

    def sandbox_spec(self) -> SandboxSpec | None:
        return SandboxSpec()

    def tools(self) -> list[ToolSpec]:
        return [BASH_TOOL]

    async def setup(self, ctx: EpisodeContext) -> None:
        return None

    async def call_tool(self, ctx: EpisodeContext, name: str, arguments: dict[str, Any]) -> ToolResult:
        if name != "bash":
            known = ", ".join(t.name for t in self.tools())
            return ToolResult(f"error: unknown tool '{name}'; available tools: {known}", is_error=True)
        command = arguments.get("command")
        if not isinstance(command, str) or not command.strip():
            return ToolResult("error: 'bash' needs a non-empty string argument 'command'", is_error=True)
        if ctx.sandbox is None:
            return ToolResult("error: this task has no sandbox", is_error=True)
        result = await ctx.sandbox.exec(command, timeout_s=self.limits.command_timeout_s)
        return ToolResult(format_exec_observation(result), exec_result=result)

    async def solve(self, ctx: EpisodeContext) -> None:
        raise NoReferenceSolution(f"task '{self.id}' has no reference solution")

    async def next_turn(self, ctx: EpisodeContext) -> list[Message] | None:
        """The task's reply when the agent ends its turn; ``None`` (the default) ends the episode."""
        return None

    @abstractmethod
    async def verify(self, ctx: EpisodeContext) -> RewardResult:
        """Score the episode."""

    async def teardown(self, ctx: EpisodeContext) -> None:
        return None

"""The environment protocol: task sources, tasks, tools, rewards and the episode context.

Messages are OpenAI chat messages (``{"role", "content", "tool_calls"?, "tool_call_id"?}``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from miles_engine.components import Section
from miles_engine.sandbox.protocol import ExecResult, Sandbox, SandboxSpec

Message = dict[str, Any]


class NoReferenceSolution(Exception):
    """The task has no reference solution (the oracle agent cannot run it)."""


class ToolSpec(BaseModel):
    """A tool offered to the agent, in OpenAI function-calling shape."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    description: str
    parameters: dict[str, Any]

    def openai_schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


BASH_TOOL = ToolSpec(
    name="bash",
    description="Run a bash command in the task's sandbox and return its exit code and output.",
    parameters={
        "type": "object",
        "properties": {"command": {"type": "string", "description": "the command to run"}},
        "required": ["command"],
    },
)


class TaskLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    agent_timeout_s: float = Field(600.0, gt=0)
    verifier_timeout_s: float = Field(600.0, gt=0)
    max_turns: int = Field(32, ge=1)
    command_timeout_s: float = Field(60.0, gt=0)


class TaskRef(BaseModel):
    """A cheap handle listed by a source before anything is loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str
    difficulty: str | None = None
    tags: tuple[str, ...] = ()
    description: str = ""


class RewardResult(Section):
    """A verifier's verdict. ``reward is None`` means "no usable reward"; ``error`` says why."""

    reward: float | None
    components: dict[str, float] = Field(default_factory=dict)
    error: str | None = None
    info: dict[str, Any] = Field(default_factory=dict)

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError(f"reward must be finite, got {v}")
        return v

    @classmethod
    def failed(cls, error: str, **info: Any) -> RewardResult:
        return cls(reward=None, error=error, info=info)


@dataclass
class ToolResult:
    content: str
    exec_result: ExecResult | None = None
    is_error: bool = False


def format_exec_observation(result: ExecResult) -> str:
    """How a ``bash`` tool result reads to the model."""
    parts = [result.stdout]
    if result.stderr:
        parts.append(result.stderr)
    text = "".join(p if p.endswith("\n") or not p else p + "\n" for p in parts)
    if result.truncated:
        text += "[output truncated]\n"
    if result.timed_out:
        text += "[command timed out]\n"
    elif result.exit_code:
        text += f"[exit code {result.exit_code}]\n"
    return text


@dataclass
class EpisodeContext:
    """What a task and an agent share during one episode."""

    task: Task
    sandbox: Sandbox | None
    transcript: list[Message] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    _call_seq: int = 0

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Run a tool as the agent would and record the call and its result in the transcript."""
        self._call_seq += 1
        call_id = f"call_{self._call_seq}"
        self.transcript.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
                ],
            }
        )
        result = await self.task.call_tool(self, name, arguments)
        self.transcript.append({"role": "tool", "tool_call_id": call_id, "content": result.content})
        return result

    async def next_turn(self) -> list[Message] | None:
        """Ask the task for its reply when the agent ends its turn (answers without a tool call).

        A task with more to say (a multi-step task's next instruction) returns the user messages
        to continue the same conversation with; they are recorded in the transcript. ``None``:
        the episode is over. Tasks opt in with an optional ``async next_turn(ctx)`` method.
        """
        reply = getattr(self.task, "next_turn", None)
        messages = await reply(self) if reply is not None else None
        if not messages:
            return None
        self.transcript.extend(messages)
        return list(messages)

    def say(self, text: str) -> None:
        """Record a final assistant message (an answer)."""
        self.transcript.append({"role": "assistant", "content": text})

    def last_assistant_text(self) -> str | None:
        for msg in reversed(self.transcript):
            if msg.get("role") == "assistant" and not msg.get("tool_calls"):
                return str(msg.get("content") or "")
        return None

    def tool_results(self) -> list[Message]:
        return [m for m in self.transcript if m.get("role") == "tool"]


@runtime_checkable
class Task(Protocol):
    id: str
    limits: TaskLimits
    metadata: dict[str, Any]

    def prompt(self) -> list[Message]:
        """The opening messages (system and user) shown to the agent."""
        ...

    def sandbox_spec(self) -> SandboxSpec | None:
        """The sandbox this task needs, or ``None`` for sandbox-less tasks."""
        ...

    def tools(self) -> list[ToolSpec]: ...

    async def setup(self, ctx: EpisodeContext) -> None: ...

    async def call_tool(self, ctx: EpisodeContext, name: str, arguments: dict[str, Any]) -> ToolResult: ...

    async def solve(self, ctx: EpisodeContext) -> None:
        """Apply the reference solution (raises :class:`NoReferenceSolution` if there is none)."""
        ...

    async def verify(self, ctx: EpisodeContext) -> RewardResult: ...

    async def teardown(self, ctx: EpisodeContext) -> None: ...


@runtime_checkable
class EnvironmentSource(Protocol):
    name: str

    def list_tasks(self) -> Iterator[TaskRef]:
        """Lazily list the tasks (cheap: no task is loaded)."""
        ...

    def load_task(self, task_id: str) -> Task:
        """Load one task; raises ``UnknownComponentError`` / ``TaskFormatError``."""
        ...

"""The agent interface: drive a task's tools inside an episode for up to ``max_turns``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from miles_engine.environments.protocol import EpisodeContext


@dataclass
class AgentResult:
    turns: int = 0
    stop_reason: str = "done"  # done | max_turns | timeout | error
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Agent(Protocol):
    name: str

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        """Work on ``ctx.task`` through ``ctx.call_tool``/``ctx.say`` until done."""
        ...

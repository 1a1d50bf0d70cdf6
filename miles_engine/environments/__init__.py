"""Environments: sources of tasks, and the task protocol the episode runner drives."""

from miles_engine.environments.capabilities import EnvironmentCapabilities, environment_capabilities
from miles_engine.environments.protocol import (
    BASH_TOOL,
    EnvironmentSource,
    EpisodeContext,
    NoReferenceSolution,
    RewardResult,
    Task,
    TaskLimits,
    TaskRef,
    ToolResult,
    ToolSpec,
)

__all__ = [
    "BASH_TOOL",
    "EnvironmentCapabilities",
    "EnvironmentSource",
    "EpisodeContext",
    "NoReferenceSolution",
    "RewardResult",
    "Task",
    "TaskLimits",
    "TaskRef",
    "ToolResult",
    "ToolSpec",
    "environment_capabilities",
]

"""OpenEnv environments as a task source: task ``<environment>/seed-<n>`` is one episode reset with seed n."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from miles_engine.environments.capabilities import EnvironmentCapabilities
from miles_engine.environments.protocol import TaskLimits, TaskRef
from miles_engine.errors import UnknownComponentError, did_you_mean

from miles_env_openenv.target import Target
from miles_env_openenv.task import OpenEnvTask, RewardMode, UnfinishedPolicy

DEFAULT_INSTRUCTION = (
    "You are acting in the OpenEnv environment '{name}'. Call the '{tool}' tool with an action to take a step; "
    "each call returns the observation, the step's reward and whether the episode is done. Keep acting until "
    "the episode is done, then reply with a short final message."
)
MAX_LISTED_IDS = 10


class OpenEnvSource:
    def __init__(self, targets: Sequence[Target], *, seeds: Sequence[int], name: str = "openenv",
                 instruction: str | None = None, limits: TaskLimits | None = None,
                 reset_kwargs: dict[str, Any] | None = None, reward_mode: RewardMode = "sum",
                 unfinished: UnfinishedPolicy = "score", connect_timeout_s: float = 30.0,
                 message_timeout_s: float = 120.0, capacity_wait_s: float = 120.0,
                 max_message_bytes: int = 16 * 2**20) -> None:
        self.name = name
        self.targets = {t.name: t for t in targets}
        self.seeds = list(dict.fromkeys(seeds))
        self.instruction = instruction
        self.limits = limits or TaskLimits()
        self.reset_kwargs = dict(reset_kwargs or {})
        self.reward_mode: RewardMode = reward_mode
        self.unfinished: UnfinishedPolicy = unfinished
        self.connect_timeout_s = connect_timeout_s
        self.message_timeout_s = message_timeout_s
        self.capacity_wait_s = capacity_wait_s
        self.max_message_bytes = max_message_bytes

    def _ids(self) -> list[str]:
        return [f"{name}/seed-{seed}" for name in self.targets for seed in self.seeds]

    def list_tasks(self) -> Iterator[TaskRef]:
        for name, target in self.targets.items():
            for seed in self.seeds:
                yield TaskRef(id=f"{name}/seed-{seed}", tags=("openenv", name), description=target.description)

    def load_task(self, task_id: str) -> OpenEnvTask:
        name, _, tail = task_id.rpartition("/seed-")
        target = self.targets.get(name)
        try:
            seed = int(tail)
        except ValueError:
            seed = None
        if target is None or seed is None or seed not in self.seeds:
            ids = self._ids()
            shown = ", ".join(ids[:MAX_LISTED_IDS]) + (f", … ({len(ids) - MAX_LISTED_IDS} more)"
                                                     if len(ids) > MAX_LISTED_IDS else "")
            raise UnknownComponentError(f"unknown task '{task_id}' in environment '{self.name}'"
                                        f"{did_you_mean(task_id, ids)}; available ({len(ids)}): {shown or 'none'}")
        instruction = (self.instruction or DEFAULT_INSTRUCTION).format(name=name, tool=target.tool_name)
        return OpenEnvTask(task_id, target, seed=seed, instruction=instruction, limits=self.limits,
                           reset_kwargs=self.reset_kwargs, reward_mode=self.reward_mode, unfinished=self.unfinished,
                           connect_timeout_s=self.connect_timeout_s, message_timeout_s=self.message_timeout_s,
                           capacity_wait_s=self.capacity_wait_s, max_message_bytes=self.max_message_bytes)

    def capabilities(self) -> EnvironmentCapabilities:
        tools = tuple(dict.fromkeys(t.tool_name for t in self.targets.values()))
        return EnvironmentCapabilities(needs_sandbox=False, multi_turn=self.limits.max_turns > 1, tools=tools,
                                       reference_solution=False,
                                       services=tuple(t.server.label for t in self.targets.values()))

    def close(self) -> None:
        """Stop every server this source started (servers given by URL are left alone)."""
        for target in self.targets.values():
            target.server.stop()

    async def aclose(self) -> None:
        self.close()

"""verifiers.v1 tasksets the adapter must refuse clearly: a runtime-only reward, and a stateful toolset."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf


class BoxTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def file_written(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
        return 1.0


class CounterState(vf.State):
    calls: int = 0


class Counter(vf.Toolset[vf.ToolsetConfig, CounterState]):
    @vf.tool
    def bump(self) -> int:
        """Count a call."""
        return 1


class CounterTask(vf.Task[vf.TaskData]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Counter(vf.ToolsetConfig())]


class BoxTaskset(vf.Taskset[BoxTask]):
    def load(self) -> Iterable[BoxTask]:
        yield BoxTask(vf.TaskData(prompt="write /tmp/x"), self.config.task)


class CounterTaskset(vf.Taskset[CounterTask]):
    def load(self) -> Iterable[CounterTask]:
        yield CounterTask(vf.TaskData(prompt="bump"), self.config.task)

"""A multi-turn verifiers.v1 taskset for the tests: the model must use the taskset's calculator toolset."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf


class Calculator(vf.Toolset):
    @vf.tool
    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    @vf.tool
    async def divide(self, a: int, b: int) -> float:
        """Divide a by b."""
        return a / b


class ProductData(vf.TaskData):
    answer: int


class ProductTask(vf.Task[ProductData]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task: ProductData, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply.strip() == str(task.answer) else 0.0

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class ProductTaskset(vf.Taskset[ProductTask]):
    def load(self) -> Iterable[ProductTask]:
        for a, b in ((123, 45), (67, 89)):
            yield ProductTask(ProductData(prompt=f"Use the calculator: what is {a} * {b}?", answer=a * b),
                              self.config.task)


__all__ = ["ProductTaskset"]

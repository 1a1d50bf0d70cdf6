"""A small verifiers.v1 taskset defined for the tests: single-turn arithmetic, scored by its own rewards."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf


class ArithData(vf.TaskData):
    answer: int


class ArithTask(vf.Task[ArithData]):
    @vf.reward
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply.strip() == str(task.answer) else 0.0

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return 1.0 if len(trace.last_reply) <= 8 else 0.0

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class ArithTaskset(vf.Taskset[ArithTask]):
    def load(self) -> Iterable[ArithTask]:
        for a, b in ((2, 3), (7, 5), (10, 4)):
            yield ArithTask(ArithData(id=f"add-{a}-{b}", prompt=f"What is {a} + {b}? Answer with the number only.",
                                      system_prompt="You are a calculator.", answer=a + b), self.config.task)


__all__ = ["ArithTaskset"]

"""Model-free agents: ``oracle`` applies the task's reference solution (step by step, when the
task continues with a next turn), ``nop`` does nothing."""

from __future__ import annotations

from miles_engine.agents.protocol import AgentResult
from miles_engine.environments.protocol import EpisodeContext


class OracleAgent:
    name = "oracle"

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        await ctx.task.solve(ctx)
        while await ctx.next_turn():  # a multi-step task: solve each step the task moves on to
            await ctx.task.solve(ctx)
        return AgentResult(turns=sum(1 for m in ctx.transcript if m.get("role") == "assistant"))


class NopAgent:
    name = "nop"

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        return AgentResult(turns=0)

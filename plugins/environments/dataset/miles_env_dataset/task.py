"""One row as a task: single-turn (a prompt, a reference answer, scored by the recipe's reward
stack) or, when the row names an image, tests or a test command, a sandboxed terminal task
with a ``bash`` tool whose test command's exit status is the task's own verdict."""

from __future__ import annotations

import shlex
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
from miles_engine.sandbox.protocol import NetworkPolicy, SandboxSpec

from miles_env_dataset.fields import TaskSpec
from miles_env_dataset.options import DatasetEnvOptions


class DatasetTask:
    def __init__(self, spec: TaskSpec, options: DatasetEnvOptions, source: str) -> None:
        self.spec, self.options, self.source = spec, options, source
        self.id = spec.id
        self.limits = TaskLimits(max_turns=options.max_turns, verifier_timeout_s=options.sandbox.test_timeout_s + 30)
        self.metadata: dict[str, Any] = {**spec.metadata, "source": source, "row": spec.row}

    def prompt(self) -> list[Message]:
        return [dict(m) for m in self.spec.prompt]

    def sandbox_spec(self) -> SandboxSpec | None:
        if not self.spec.sandboxed:
            return None
        sb = self.options.sandbox
        return SandboxSpec(image=self.spec.image, workdir=sb.workdir, paths=(sb.workdir, sb.tests_dir),
                           network=NetworkPolicy(mode="none"),
                           labels={"miles.source": self.source, "miles.task": self.id})

    def tools(self) -> list[ToolSpec]:
        return [BASH_TOOL] if self.spec.sandboxed else []

    async def setup(self, ctx: EpisodeContext) -> None:
        if ctx.sandbox is not None:
            for name, code in (self.spec.tests or {}).items():
                await ctx.sandbox.write_file(f"{self.options.sandbox.tests_dir}/{name}", code)

    async def call_tool(self, ctx: EpisodeContext, name: str, arguments: dict[str, Any]) -> ToolResult:
        if name != "bash" or not self.spec.sandboxed:
            known = ", ".join(t.name for t in self.tools()) or "none"
            return ToolResult(f"error: unknown tool '{name}'; available tools: {known}", is_error=True)
        command = arguments.get("command") if isinstance(arguments, dict) else None
        if not isinstance(command, str) or not command.strip():
            return ToolResult("error: 'bash' needs a non-empty string argument 'command'", is_error=True)
        if ctx.sandbox is None:
            return ToolResult("error: this task has no sandbox", is_error=True)
        result = await ctx.sandbox.exec(command, timeout_s=self.limits.command_timeout_s)
        return ToolResult(format_exec_observation(result), exec_result=result)

    async def solve(self, ctx: EpisodeContext) -> None:
        if self.spec.answer is None:
            raise NoReferenceSolution(f"task '{self.id}' (row {self.spec.row}) has no reference answer")
        ctx.say(str(self.spec.answer))

    def test_command(self) -> str | None:
        if self.spec.test_command:
            return self.spec.test_command
        if self.spec.tests:
            tests_dir = shlex.quote(self.options.sandbox.tests_dir)
            return self.options.sandbox.default_test_command.format(tests_dir=tests_dir)
        return None

    async def verify(self, ctx: EpisodeContext) -> RewardResult:
        command = self.test_command()
        if command is not None:
            if ctx.sandbox is None:
                return RewardResult.failed(f"task '{self.id}' runs a test command but has no sandbox")
            run = await ctx.sandbox.exec(command, timeout_s=self.options.sandbox.test_timeout_s)
            if run.timed_out:
                return RewardResult.failed(f"test command timed out after {self.options.sandbox.test_timeout_s:g}s")
            return RewardResult(reward=1.0 if run.exit_code == 0 else 0.0, components={"tests_passed": float(run.ok)},
                                info={"exit_code": run.exit_code, "output": (run.stdout + run.stderr)[-400:]})
        if self.spec.answer is not None:  # the recipe's reward stack (e.g. math-answer) usually replaces this
            answer = ctx.last_assistant_text()
            ok = answer is not None and answer.strip() == str(self.spec.answer).strip()
            return RewardResult(reward=float(ok), info={"answer": None if answer is None else answer[:200]})
        return RewardResult.failed(f"task '{self.id}' has no answer, tests or test command: score it with the "
                                   f"recipe's reward.components")

    async def teardown(self, ctx: EpisodeContext) -> None:
        return None

"""Templates of ``miles new plugin --kind agent`` (agents have no contract suite: an episode test)."""

from miles_engine.scaffold import readme

FILES = {
    "README.md": readme(),
    "PACKAGE/plugin.py": '''\
"""Registers the `$name` agent."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from miles_engine import hookimpl
from miles_engine.agents.protocol import AgentResult
from miles_engine.components import Component
from miles_engine.environments.protocol import EpisodeContext


class ${cls}Options(BaseModel):
    """Options of `$name`; unknown keys are an error."""

    model_config = ConfigDict(extra="forbid")
    commands: list[str] = Field(default_factory=lambda: ["ls"], description="bash commands run in order")
    max_turns: int = Field(8, ge=1)


class ${cls}Agent:
    """Runs fixed commands through the task's `bash` tool, then answers with the last output."""

    name = "$name"

    def __init__(self, options: ${cls}Options) -> None:
        self.options = options

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        turns, output = 0, ""
        for command in self.options.commands[: self.options.max_turns]:
            output = (await ctx.call_tool("bash", {"command": command})).content
            turns += 1
        ctx.say(output.strip())
        stop = "max_turns" if len(self.options.commands) > self.options.max_turns else "done"
        return AgentResult(turns=turns, stop_reason=stop)


@hookimpl
def miles_register_agents() -> list[Component]:
    return [Component("$name", ${cls}Agent, options=${cls}Options, description="runs fixed bash commands")]
''',
    "tests/test_agent.py": '''\
"""`$name` registers through the hub and drives a real episode on the local sandbox."""

import asyncio
from importlib import import_module

from miles_engine.environments.base import SandboxTask
from miles_engine.environments.protocol import RewardResult
from miles_engine.hub import Hub, get_plugin_manager
from miles_engine.rollout.episode import run_episode


class EchoTask(SandboxTask):
    """Reward 1 when answer.txt holds 'hello'."""

    def prompt(self):
        return [{"role": "user", "content": "Write hello to answer.txt"}]

    async def verify(self, ctx):
        done = await ctx.sandbox.exec("cat answer.txt", timeout_s=10)
        return RewardResult(reward=float(done.stdout.strip() == "hello"))


def hub():
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(import_module("$package.plugin"), name="$package.plugin")
    return Hub(pm)


def test_episode():
    async def go():
        h = hub()
        agent = h.create("agent", "$name", {"commands": ["echo hello > answer.txt", "cat answer.txt"]})
        backend = h.create("sandbox", "local", {})
        try:
            return await run_episode(EchoTask("echo"), agent, backend)
        finally:
            await backend.aclose()

    result = asyncio.run(asyncio.wait_for(go(), 60))
    assert result.reward.reward == 1.0 and result.agent.turns == 2
    assert result.transcript[-1] == {"role": "assistant", "content": "hello"}
''',
}

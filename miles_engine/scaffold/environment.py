"""Templates of ``miles new plugin --kind environment``."""

from miles_engine.scaffold import readme

FILES = {
    "README.md": readme(),
    "PACKAGE/plugin.py": '''\
"""Registers the `$name` environment: tasks asking the agent to write a word to a file."""

from __future__ import annotations

import shlex
from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field

from miles_engine import hookimpl
from miles_engine.components import Component
from miles_engine.environments.base import SandboxTask
from miles_engine.environments.protocol import EpisodeContext, Message, RewardResult, TaskRef
from miles_engine.errors import UnknownComponentError

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")


class ${cls}Options(BaseModel):
    """Options of `$name`; unknown keys are an error."""

    model_config = ConfigDict(extra="forbid")
    num_tasks: int = Field(4, ge=1, le=len(WORDS))


class ${cls}Task(SandboxTask):
    def __init__(self, task_id: str, word: str) -> None:
        super().__init__(task_id, metadata={"answer": word})
        self.word = word

    def prompt(self) -> list[Message]:
        return [{"role": "user", "content": f"Write the word {self.word} to answer.txt, then stop."}]

    async def solve(self, ctx: EpisodeContext) -> None:
        await ctx.call_tool("bash", {"command": f"echo {shlex.quote(self.word)} > answer.txt"})

    async def verify(self, ctx: EpisodeContext) -> RewardResult:
        assert ctx.sandbox is not None
        done = await ctx.sandbox.exec("cat answer.txt", timeout_s=10)
        return RewardResult(reward=float(done.ok and done.stdout.strip() == self.word))


class ${cls}Source:
    name = "$name"

    def __init__(self, options: ${cls}Options) -> None:
        self.words = {f"$name-{i}": WORDS[i] for i in range(options.num_tasks)}

    def list_tasks(self) -> Iterator[TaskRef]:
        for task_id in self.words:
            yield TaskRef(id=task_id, description="write a word to a file")

    def load_task(self, task_id: str) -> ${cls}Task:
        if task_id not in self.words:
            raise UnknownComponentError(f"environment '$name' has no task '{task_id}'; it has {', '.join(self.words)}")
        return ${cls}Task(task_id, self.words[task_id])


@hookimpl
def miles_register_environments() -> list[Component]:
    return [Component("$name", ${cls}Source, options=${cls}Options, description="write a word to a file")]
''',
    "tests/test_contract.py": '''\
"""`$name` passes the environment contract suite (registered programmatically: no install needed)."""

from importlib import import_module

import pytest

from miles_engine.hub import Hub, get_plugin_manager
from miles_engine.testing.environment import EnvironmentContract


def hub():
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(import_module("$package.plugin"), name="$package.plugin")
    return Hub(pm)


class Test${cls}Contract(EnvironmentContract):
    @pytest.fixture
    def source(self):
        return hub().create("environment", "$name", {"num_tasks": 2})
''',
}

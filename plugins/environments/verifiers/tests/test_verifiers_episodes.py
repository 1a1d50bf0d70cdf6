"""verifiers.v1 tasksets defined in the tests, run end to end through our episode runner: our scripted
agent generates, the taskset's own rewards score."""

from __future__ import annotations

import asyncio
import json

import pytest

from miles_engine.agents.builtin import NopAgent, OracleAgent
from miles_engine.agents.protocol import AgentResult
from miles_engine.errors import ConfigError, TaskFormatError, UnknownComponentError
from miles_engine.hub import Hub, get_plugin_manager
from miles_engine.rollout.episode import run_episode
from miles_env_verifiers import plugin

pytestmark = pytest.mark.timeout(180)


def make(**options):
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(plugin)
    return Hub(pm).create("environment", "verifiers", options)


def run(coro):
    return asyncio.run(coro)


class Answer:
    """Reads the question from the prompt and answers (optionally wrongly, optionally verbosely)."""

    name = "answer"

    def __init__(self, offset: int = 0, padding: str = "") -> None:
        self.offset = offset
        self.padding = padding

    async def run(self, ctx):
        question = ctx.task.prompt()[-1]["content"]
        a, b = (int(x) for x in question.split("What is ")[1].split("?")[0].split(" + "))
        ctx.say(f"{self.padding}{a + b + self.offset}")
        return AgentResult(turns=1)


class UseCalculator:
    """Multi-turn: bad arguments, a raising tool, then the right call, then the answer."""

    name = "calculator"

    def __init__(self) -> None:
        self.results = []

    async def run(self, ctx):
        a, b = (int(x) for x in ctx.task.prompt()[-1]["content"].split("what is ")[1].rstrip("?").split(" * "))
        for name, args in (("multiply", {"a": "many", "b": b}), ("divide", {"a": a, "b": 0}),
                           ("multiply", {"a": a, "b": b})):
            self.results.append(await ctx.call_tool(name, args))
        ctx.say(self.results[-1].content)
        return AgentResult(turns=4)


@pytest.fixture(scope="module")
def arith():
    return make(taskset="toy_vf_arith")


def test_single_turn_tasks_scored_by_the_taskset_rewards(arith):
    ids = [r.id for r in arith.list_tasks()]
    assert ids == ["add-2-3", "add-7-5", "add-10-4"]
    task = arith.load_task("add-7-5")
    assert task.prompt() == [{"role": "system", "content": "You are a calculator."},
                             {"role": "user", "content": "What is 7 + 5? Answer with the number only."}]
    assert task.sandbox_spec() is None and task.tools() == []

    async def batch():
        return await asyncio.gather(run_episode(arith.load_task("add-7-5"), Answer(), None),
                                    run_episode(arith.load_task("add-2-3"), Answer(offset=1), None),
                                    run_episode(arith.load_task("add-10-4"), Answer(padding="The answer is "), None))

    right, wrong, verbose = run(batch())
    assert (right.reward.reward, right.reward.components) == (1.5, {"correct": 1.0, "brief": 1.0})
    assert right.reward.info["weights"] == {"correct": 1.0, "brief": 0.5}
    assert right.reward.info["metrics"] == {"turns": 1.0}
    assert (wrong.reward.reward, wrong.reward.components["correct"]) == (0.5, 0.0)
    assert verbose.reward.reward == 0.0  # 'The answer is 14' is neither exact nor brief


def test_no_answer_is_scored_as_the_taskset_says_and_the_oracle_has_no_solution(arith):
    nop = run(run_episode(arith.load_task("add-2-3"), NopAgent(), None))
    # an empty reply is wrong but (by this taskset's rule) brief
    assert (nop.reward.reward, nop.reward.components, nop.reward.error) == (0.5, {"correct": 0.0, "brief": 1.0}, None)
    oracle = run(run_episode(arith.load_task("add-2-3"), OracleAgent(), None))
    assert oracle.reward.reward is None and "no reference solution" in oracle.reward.error


def test_multi_turn_toolset_episode():
    source = make(taskset="toy_vf_tools")
    assert [r.id for r in source.list_tasks()] == ["0", "1"]  # no durable ids: positions
    assert source.capabilities().tools == ("divide", "multiply") and source.capabilities().multi_turn
    task = source.load_task("0")
    multiply = next(t for t in task.tools() if t.name == "multiply")
    assert multiply.description == "Multiply two integers."
    assert multiply.parameters["required"] == ["a", "b"]
    agent = UseCalculator()
    result = run(run_episode(task, agent, None))
    bad, raised, good = agent.results
    assert bad.is_error and "invalid arguments for 'multiply'" in bad.content and "a:" in bad.content
    assert raised.is_error and "ZeroDivisionError" in raised.content
    assert not good.is_error and json.loads(good.content) == 123 * 45
    assert (result.reward.reward, result.reward.error) == (1.0, None)
    assert result.reward.info["metrics"] == {"tool_calls": 3.0}
    unknown = run(run_episode(source.load_task("1"), _CallUnknown(), None))
    assert unknown.reward.reward == 0.0


class _CallUnknown:
    name = "unknown"

    async def run(self, ctx):
        result = await ctx.call_tool("bash", {"command": "ls"})
        assert result.is_error and "available tools: divide, multiply" in result.content
        return AgentResult(turns=1)


def test_runtime_only_rewards_are_refused_not_silently_skipped():
    source = make(taskset="toy_vf_box")
    result = run(run_episode(source.load_task("0"), NopAgent(), None))
    assert result.reward.reward is None and "file_written" in result.reward.error
    assert "verifiers runtime" in result.reward.error


def test_bad_input_names_the_cause(arith):
    with pytest.raises(ConfigError, match="cannot load taskset 'no_such_taskset_xyz'"):
        make(taskset="no_such_taskset_xyz")
    with pytest.raises(ConfigError, match="invalid config for taskset 'toy_vf_arith'"):
        make(taskset="toy_vf_arith", config={"no_such_key": 1})
    with pytest.raises(UnknownComponentError, match="add-2-4.*did you mean 'add-2-3'"):
        arith.load_task("add-2-4")
    with pytest.raises(TaskFormatError, match="Counter keeps its own State"):
        make(taskset="toy_vf_counter").load_task("0")


def test_registered_by_entry_point():
    registered = Hub().registry("environment")["verifiers"]
    assert registered.distribution == "miles-env-verifiers" and not registered.builtin

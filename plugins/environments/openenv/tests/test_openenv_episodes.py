"""OpenEnv episodes end to end: a real server (OpenEnv's create_app + uvicorn on 127.0.0.1), our
episode runner, scripted agents."""

from __future__ import annotations

import asyncio
import json

import pytest
from openenv_testkit import BisectingAgent, FixedAgent, free_port, serve

from miles_engine.agents.builtin import NopAgent, OracleAgent
from miles_engine.errors import ConfigError, UnknownComponentError
from miles_engine.hub import Hub, get_plugin_manager
from miles_engine.rollout.episode import run_episode
from miles_env_openenv import plugin

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server_url():
    toy = pytest.importorskip("toy_openenv")
    with serve(toy.make_app(max_concurrent_envs=8)) as url:
        yield url


def make(**options):
    """Build through the hub (options validated as in a recipe) with only this plugin registered."""
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(plugin)
    return Hub(pm).create("environment", "openenv", options)


def run(coro):
    return asyncio.run(coro)


def test_bisecting_agent_solves_every_seed_concurrently(server_url):
    source = make(url=server_url, seeds=[0, 3, 5, 9])
    ids = [r.id for r in source.list_tasks()]
    assert ids == ["openenv/seed-0", "openenv/seed-3", "openenv/seed-5", "openenv/seed-9"]

    async def all_episodes():
        return await asyncio.gather(*(run_episode(source.load_task(i), BisectingAgent(), None) for i in ids))

    results = run(all_episodes())
    for result in results:
        assert (result.reward.reward, result.reward.error) == (1.0, None), result.reward
        assert result.reward.info["done"] is True
        assert result.reward.info["state"]["step_count"] == result.reward.info["steps"] >= 1
        assert result.info["openenv"]["url"] == server_url.replace("http", "ws") + "/ws"
        calls = [m for m in result.transcript if m.get("tool_calls")]
        assert calls and calls[0]["tool_calls"][0]["function"]["name"] == "step"
    # the secret is seed % 10: seed 9 takes the most bisection steps, and each step was scored
    assert results[3].reward.info["step_rewards"][-1] == 1.0
    assert all(r == 0.0 for r in results[3].reward.info["step_rewards"][:-1])


def test_prompt_holds_the_reset_observation_and_the_tool_is_the_action_schema(server_url):
    task = make(url=server_url, seeds=[4]).load_task("openenv/seed-4")
    assert "Initial observation" not in task.prompt()[0]["content"]
    (tool,) = task.tools()
    assert tool.name == "step"
    assert tool.parameters["properties"]["guess"]["maximum"] == 9
    assert tool.parameters["required"] == ["guess"] and "metadata" not in tool.parameters["properties"]
    assert "guess the secret number" in tool.description

    class Peek:
        name = "peek"
        seen: str = ""

        async def run(self, ctx):
            Peek.seen = ctx.task.prompt()[0]["content"]
            return await BisectingAgent().run(ctx)

    result = run(run_episode(task, Peek(), None))
    assert "Initial observation:" in Peek.seen and "guess a number from 0 to 9" in Peek.seen
    assert result.reward.reward == 1.0


def test_refused_actions_keep_the_episode_going_and_done_ends_it(server_url):
    source = make(url=server_url, seeds=[3])
    agent = FixedAgent({"guess": 42}, {"guess": 7}, {"guess": 3}, {"guess": 1})
    result = run(run_episode(source.load_task("openenv/seed-3"), agent, None))
    bad, raised, right, late = agent.results
    assert bad.is_error and "VALIDATION_ERROR" in bad.content and "guess" in bad.content
    assert raised.is_error and "EXECUTION_ERROR" in raised.content and "refuses 7" in raised.content
    assert not right.is_error and json.loads(right.content.splitlines()[0])["hint"] == "correct"
    assert "reward: 1" in right.content and "done:" in right.content
    assert late.is_error and "episode is over" in late.content
    assert (result.reward.reward, result.reward.info["steps"]) == (1.0, 1)


def test_unknown_tool_name_is_refused(server_url):
    agent = FixedAgent({"guess": 1}, tool="bash")
    run(run_episode(make(url=server_url, seeds=[1]).load_task("openenv/seed-1"), agent, None))
    assert agent.results[0].is_error and "available tools: step" in agent.results[0].content


def test_unfinished_episode_policies(server_url):
    scored = run(run_episode(make(url=server_url, seeds=[2]).load_task("openenv/seed-2"), NopAgent(), None))
    assert (scored.reward.reward, scored.reward.info["done"]) == (0.0, False)
    failed = run(run_episode(make(url=server_url, seeds=[2], unfinished="fail").load_task("openenv/seed-2"),
                             FixedAgent({"guess": 0}), None))
    assert failed.reward.reward is None and "did not reach done after 1 step" in failed.reward.error
    last = run(run_episode(make(url=server_url, seeds=[2], reward="last").load_task("openenv/seed-2"),
                           FixedAgent({"guess": 0}, {"guess": 2}), None))
    assert last.reward.reward == 1.0


def test_oracle_has_no_reference_solution(server_url):
    result = run(run_episode(make(url=server_url, seeds=[1]).load_task("openenv/seed-1"), OracleAgent(), None))
    assert result.reward.reward is None and "no reference solution" in result.reward.error


def test_unreachable_server_fails_the_episode_with_the_url_and_the_run_continues(server_url):
    dead = f"http://127.0.0.1:{free_port()}"
    bad_source = make(url=dead, seeds=[1], connect_timeout_s=5)
    good_source = make(url=server_url, seeds=[1])

    async def batch():
        return await asyncio.gather(run_episode(bad_source.load_task("openenv/seed-1"), BisectingAgent(), None),
                                    run_episode(good_source.load_task("openenv/seed-1"), BisectingAgent(), None))

    bad, good = run(batch())
    assert bad.reward.reward is None and dead in bad.reward.error and "unreachable" in bad.reward.error
    assert bad.reward.error.startswith("setup of task 'openenv/seed-1' failed")
    assert good.reward.reward == 1.0


def test_session_limit_is_waited_out():
    toy = pytest.importorskip("toy_openenv")
    with serve(toy.make_app(max_concurrent_envs=1)) as url:
        source = make(url=url, seeds=[5, 6], capacity_wait_s=30)

        async def both():
            return await asyncio.gather(*(run_episode(source.load_task(f"openenv/seed-{s}"), BisectingAgent(), None)
                                          for s in (5, 6)))

        assert [r.reward.reward for r in run(both())] == [1.0, 1.0]


def test_bad_options_and_ids_name_the_cause(server_url):
    with pytest.raises(ConfigError, match="at most one of url, app and envs"):
        make(url=server_url, app="x:y")
    with pytest.raises(ConfigError, match="http:// or https://"):
        make(url="ws://127.0.0.1:1")
    with pytest.raises(ConfigError, match="not installed OpenEnv packages"):
        make(envs=["no-such-env"])
    with pytest.raises(UnknownComponentError, match="openenv/seed-77.*available \\(2\\)"):
        make(url=server_url, seeds=[1, 2]).load_task("openenv/seed-77")

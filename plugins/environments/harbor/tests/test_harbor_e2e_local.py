"""Real Harbor tasks (real bash test.sh / solve.sh) on the built-in local sandbox backend."""

from __future__ import annotations

import asyncio
import json

import pytest
from harbor_testkit import make_task

from miles_engine.agents.builtin import NopAgent, OracleAgent
from miles_engine.agents.protocol import AgentResult
from miles_engine.environments.protocol import EpisodeContext
from miles_engine.hub import default_hub
from miles_engine.rollout.validate import validate_environment
from miles_engine.errors import SandboxUnsupportedError
from miles_engine.hub import Hub, get_plugin_manager
from miles_engine.rollout.episode import run_episode
from miles_env_harbor import SANDBOX_FACTORY_KEY, HarborSource, load_harbor_task

@pytest.fixture(scope="module")
def backend():
    """The built-in local backend; skipped (visibly) where it cannot map the task paths."""
    local = Hub(get_plugin_manager(load_entrypoints=False)).create("sandbox", "local")
    caps = local.capabilities()
    if not (caps.absolute_paths and "none" in caps.network_modes):
        pytest.skip(f"the local sandbox achieves only '{caps.isolation}' isolation here: "
                    "no absolute task paths (/app, /logs, /tests) or no network isolation")
    yield local
    asyncio.run(local.aclose())


def run(coro):
    return asyncio.run(coro)


class ScriptedAgent:
    """Runs fixed bash commands through the task's tool, recording the outputs."""

    name = "scripted"

    def __init__(self, *commands: str) -> None:
        self.commands = commands
        self.outputs: list[str] = []

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        for command in self.commands:
            self.outputs.append((await ctx.call_tool("bash", {"command": command})).content)
        return AgentResult(turns=len(self.commands))


def test_oracle_scores_one_and_nop_zero(backend, tmp_path):
    task_dir = make_task(tmp_path)
    oracle = run(run_episode(load_harbor_task(task_dir), OracleAgent(), backend))
    assert (oracle.reward.reward, oracle.reward.error) == (1.0, None), oracle.reward
    nop = run(run_episode(load_harbor_task(task_dir), NopAgent(), backend))
    assert (nop.reward.reward, nop.reward.error) == (0.0, None), nop.reward


def test_tests_are_invisible_to_the_agent_and_stale_rewards_do_not_count(backend, tmp_path):
    task = load_harbor_task(make_task(tmp_path, test_sh="#!/bin/bash\necho 'I forgot the reward'\n"))
    agent = ScriptedAgent("ls -A /tests /solution; echo listed",
                          "echo 1 > /logs/verifier/reward.txt && echo '{\"reward\": 1}' > /logs/verifier/reward.json")
    result = run(run_episode(task, agent, backend))
    assert "test.sh" not in agent.outputs[0] and "solve.sh" not in agent.outputs[0]
    assert result.reward.reward is None and "wrote no reward" in result.reward.error
    assert result.reward.info["test_stdout_tail"] == "I forgot the reward\n"


def test_reward_json_components_and_verifier_env(backend, tmp_path):
    test_sh = ('#!/bin/bash\nprintf \'{"reward": %s, "style": 0.5}\' "$SCORE" > /logs/verifier/reward.json\n'
               "echo 0 > /logs/verifier/reward.txt\n")
    task = load_harbor_task(make_task(tmp_path, test_sh=test_sh, toml='[verifier]\nenv = { SCORE = "1" }\n'))
    result = run(run_episode(task, NopAgent(), backend))
    assert result.reward.reward == 1.0 and result.reward.components == {"reward": 1.0, "style": 0.5}


@pytest.mark.parametrize(
    ("line", "needle"),
    [("printf '' > /logs/verifier/reward.txt", "reward.txt: reward file is empty"),
     ("echo 'all good' > /logs/verifier/reward.txt", "does not hold one number: 'all good'"),
     ("echo nan > /logs/verifier/reward.txt", "is nan"),
     ("echo '{\"reward\": \"yes\"}' > /logs/verifier/reward.json", "'reward' must be a number, got str")],
)
def test_garbage_rewards_fail_the_sample(backend, tmp_path, line, needle):
    task = load_harbor_task(make_task(tmp_path, test_sh=f"#!/bin/bash\n{line}\n"))
    result = run(run_episode(task, NopAgent(), backend))
    assert result.reward.reward is None and result.reward.error.startswith("task 'answer': /logs/verifier/reward.")
    assert needle in result.reward.error


def test_separate_verifier_mode_uses_a_fresh_sandbox(backend, tmp_path):
    toml = 'artifacts = ["/app/answer.txt"]\n[verifier]\nenvironment_mode = "separate"\n'
    test_sh = ("#!/bin/bash\n[ -e /app/agent-only ] && { echo 0 > /logs/verifier/reward.txt; exit; }\n"
                      "[ \"$(cat /app/answer.txt)\" = 42 ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")
    task = load_harbor_task(make_task(tmp_path, toml=toml, test_sh=test_sh,
                                      solve_sh="#!/bin/bash\necho 42 > /app/answer.txt\ntouch /app/agent-only\n"))

    agent = ScriptedAgent("echo agent log > /logs/artifacts/notes.txt")

    class SolveThenAct(OracleAgent):
        async def run(self, ctx):
            await super().run(ctx)
            return await agent.run(ctx)

    result = run(run_episode(task, SolveThenAct(), backend)).reward
    assert (result.reward, result.error) == (1.0, None), result
    assert result.info["verifier_mode"] == "separate" and result.info["artifacts"] == ["/logs/artifacts", "/app/answer.txt"]


def test_separate_verifier_never_touches_the_agents_sandbox(backend, tmp_path):
    toml = '[verifier]\nenvironment_mode = "separate"\n'
    task = load_harbor_task(make_task(tmp_path, toml=toml))

    async def episode():
        async with await backend.create(task.sandbox_spec()) as sb:
            ctx = EpisodeContext(task=task, sandbox=sb, info={SANDBOX_FACTORY_KEY: backend.create})
            await task.setup(ctx)
            result = await task.verify(ctx)
            return result, (await sb.exec("ls -A /tests /logs/verifier")).stdout

    result, listing = run(episode())
    assert result.reward == 0.0 and "test.sh" not in listing and "reward" not in listing


def test_docker_image_task_is_refused_by_the_local_backend(backend, tmp_path):
    task = load_harbor_task(make_task(tmp_path, toml='[environment]\ndocker_image = "ubuntu:24.04"\n'))
    with pytest.raises(SandboxUnsupportedError, match="container image 'ubuntu:24.04'"):
        run(run_episode(task, OracleAgent(), backend))
    task2 = load_harbor_task(make_task(tmp_path, "built", files={"environment/Dockerfile": "FROM debian\n"}))
    with pytest.raises(SandboxUnsupportedError, match="Docker build"):
        run(run_episode(task2, OracleAgent(), backend))


def test_validate_a_small_dataset(backend, tmp_path):
    make_task(tmp_path, "good")
    make_task(tmp_path, "no-solution", solve_sh=None)
    make_task(tmp_path, "always-one", test_sh="#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    checks = {c.task_id: c
              for c in run(validate_environment(HarborSource(tmp_path), backend, hub=default_hub(), jobs=3))}
    assert checks["good"].passed, checks["good"].problems
    assert "no reference solution" in " ".join(checks["no-solution"].problems)
    assert checks["always-one"].problems == ["no-op scored 1.0 (expected 0.0)"]
    assert json.dumps([c.to_dict() for c in checks.values()])


def test_a_healthcheck_gates_the_agent_on_the_local_backend_too(backend, tmp_path):
    from harbor_testkit import DEFAULT_TOML

    check = '\n[environment.healthcheck]\ncommand = "test -f /app/ready || {{ echo not ready; exit 1; }}"\n' \
            'interval_sec = 0\nretries = 2\n'
    never = make_task(tmp_path, "never", toml=DEFAULT_TOML + check.format())
    failed = run(run_episode(load_harbor_task(never), OracleAgent(), backend))
    assert failed.reward.reward is None and failed.agent.stop_reason == "not_started", failed.reward
    assert "HealthcheckError" in failed.reward.error and "`test -f /app/ready" in failed.reward.error
    assert "its last output: not ready" in failed.reward.error
    ready = make_task(tmp_path, "ready", toml=DEFAULT_TOML + check.format().replace("test -f /app/ready", "true"))
    passed = run(run_episode(load_harbor_task(ready), OracleAgent(), backend))
    assert (passed.reward.reward, passed.info["healthcheck"]["tries"]) == (1.0, 1), passed.reward

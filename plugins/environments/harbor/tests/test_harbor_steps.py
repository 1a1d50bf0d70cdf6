"""Multi-step Harbor tasks, [verifier.env] / [solution.env] and artifacts, with real bash on the
local sandbox backend (docker adds nothing here; the docker backend runs a two-step task in
plugins/sandboxes/docker/tests/tasks/harbor/two-steps)."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest
from harbor_testkit import make_task

from miles_engine.agents.builtin import NopAgent, OracleAgent
from miles_engine.agents.protocol import AgentResult
from miles_engine.environments.protocol import EpisodeContext
from miles_engine.errors import TaskFormatError, TaskUnsupportedError
from miles_engine.hub import Hub, get_plugin_manager
from miles_engine.rollout.episode import run_episode
from miles_env_harbor import HarborSource, load_harbor_task


@pytest.fixture(scope="module")
def backend():
    local = Hub(get_plugin_manager(load_entrypoints=False)).create("sandbox", "local")
    caps = local.capabilities()
    if not (caps.absolute_paths and "none" in caps.network_modes):
        pytest.skip(f"the local sandbox achieves only '{caps.isolation}' isolation here: no task paths")
    yield local
    asyncio.run(local.aclose())


def run(coro):
    return asyncio.run(coro)


def check_file(path: str, want: str) -> str:
    return (f'#!/bin/bash\nif [ "$(cat {path} 2>/dev/null)" = "{want}" ]; then echo 1 > /logs/verifier/reward.txt; '
            f"else echo 0 > /logs/verifier/reward.txt; fi\n")


def two_step_task(root: Path, *, toml_extra: str = "", second_solution: bool = True) -> Path:
    """Step 'write' wants /app/a = 1; step 'extend' wants /app/b = 2 (and, through the shared
    tests/helper.sh uploaded under its own tests, /app/a still in place)."""
    toml = 'schema_version = "1.4"\n' + textwrap.dedent(toml_extra) + (
        '[agent]\ntimeout_sec = 30\n[verifier]\ntimeout_sec = 20\n'
        '[[steps]]\nname = "write"\n[[steps]]\nname = "extend"\n[steps.agent]\ntimeout_sec = 15\n')
    files = {
        "tests/helper.sh": "a_ok() { [ \"$(cat /app/a 2>/dev/null)\" = 1 ]; }\n",
        "steps/write/instruction.md": "Write 1 to /app/a.\n",
        "steps/write/tests/test.sh": check_file("/app/a", "1"),
        "steps/write/solution/solve.sh": "#!/bin/bash\necho 1 > /app/a\n",
        "steps/extend/instruction.md": "Now write 2 to /app/b.\n",
        "steps/extend/tests/test.sh": ('#!/bin/bash\n. /tests/helper.sh\n'
                                       'if a_ok && [ "$(cat /app/b 2>/dev/null)" = 2 ]; then echo 1 > /logs/verifier/reward.txt; '
                                       'else echo 0 > /logs/verifier/reward.txt; fi\n'),
    }
    if second_solution:
        files["steps/extend/solution/solve.sh"] = "#!/bin/bash\necho 2 > /app/b\n"
    return make_task(root, "two-steps", toml=toml, instruction=None, test_sh=None, solve_sh=None, files=files)


def test_two_step_oracle_scores_one_and_nop_zero(backend, tmp_path):
    task = load_harbor_task(two_step_task(tmp_path))
    assert task.has_reference_solution and HarborSource(tmp_path).capabilities().reference_solution
    assert task.prompt() == [{"role": "user", "content": "Write 1 to /app/a.\n"}]
    assert task.limits.agent_timeout_s == 30 + 15 + 2 * (20 + 30) and task.limits.verifier_timeout_s == 2 * (20 + 30)
    oracle = run(run_episode(task, OracleAgent(), backend))
    assert (oracle.reward.reward, oracle.reward.error) == (1.0, None), oracle.reward
    assert oracle.reward.components == {"reward": 1.0, "steps.write.reward": 1.0, "steps.extend.reward": 1.0}
    assert [m["content"] for m in oracle.transcript if m["role"] == "user"] == ["Now write 2 to /app/b.\n"]
    nop = run(run_episode(task, NopAgent(), backend))
    assert (nop.reward.reward, nop.reward.error) == (0.0, None), nop.reward
    assert [s["name"] for s in nop.info["harbor_steps"]["steps"]] == ["write", "extend"]  # both verified


@pytest.mark.parametrize(("strategy", "expected"), [("", 0.5), ('multi_step_reward_strategy = "mean"\n', 0.5),
                                                    ('multi_step_reward_strategy = "final"\n', 0.0)])
def test_step_one_only_solution_gives_harbors_aggregate(backend, tmp_path, strategy, expected):
    task = load_harbor_task(two_step_task(tmp_path, toml_extra=strategy, second_solution=False))
    result = run(run_episode(task, OracleAgent(), backend))
    assert (result.reward.reward, result.reward.error) == (expected, None), result.reward
    assert result.reward.components["steps.write.reward"] == 1.0
    assert result.reward.components["steps.extend.reward"] == 0.0
    solution = result.info["solution"]
    assert solution["steps"]["extend"] == {"skipped": "no steps/extend/solution/solve.sh"}
    assert (solution["exit_code"], solution["timed_out"], solution["steps"]["write"]["exit_code"]) == (0, False, 0)


class StepAgent:
    """Answers each instruction with fixed commands; records the user messages it was given."""

    name = "steps"

    def __init__(self, *per_step: list[str]) -> None:
        self.per_step = per_step
        self.seen: list[str] = []

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        messages = ctx.task.prompt()
        for commands in self.per_step:
            self.seen.append(messages[-1]["content"])
            for command in commands:
                await ctx.call_tool("bash", {"command": command})
            ctx.say("done")
            messages = await ctx.next_turn()
            if not messages:
                break
        return AgentResult(turns=len(self.seen))


def test_the_next_instruction_comes_after_the_step_is_verified(backend, tmp_path):
    task = load_harbor_task(two_step_task(tmp_path))
    agent = StepAgent(["echo 1 > /app/a", "ls -A /tests /solution 2>&1; true"], ["echo 2 > /app/b"])
    result = run(run_episode(task, agent, backend))
    assert agent.seen == ["Write 1 to /app/a.\n", "Now write 2 to /app/b.\n"]
    assert result.reward.reward == 1.0 and result.reward.error is None
    # the agent's tools never showed it the tests or a solution (tests arrive at verification only)
    listing = [m["content"] for m in result.transcript if m["role"] == "tool"][1]
    assert "test.sh" not in listing and "solve.sh" not in listing


def test_min_reward_stops_the_remaining_steps(backend, tmp_path):
    task_dir = two_step_task(tmp_path)
    toml = (task_dir / "task.toml").read_text().replace('name = "write"\n', 'name = "write"\nmin_reward = 1.0\n')
    (task_dir / "task.toml").write_text(toml)
    result = run(run_episode(load_harbor_task(task_dir), StepAgent(["true"], ["echo 2 > /app/b"]), backend))
    steps = result.info["harbor_steps"]
    assert [s["name"] for s in steps["steps"]] == ["write"]
    assert steps["stopped"] == "step 'write': reward = 0 is below min_reward 1"
    assert result.reward.reward == 0.0 and "steps.extend.reward" not in result.reward.components


def test_a_step_without_reward_ends_the_episode_and_is_left_out_of_the_mean(backend, tmp_path):
    task_dir = two_step_task(tmp_path)
    (task_dir / "steps/extend/tests/test.sh").write_text("#!/bin/bash\necho forgot\n")
    result = run(run_episode(load_harbor_task(task_dir), OracleAgent(), backend))
    assert (result.reward.reward, result.reward.error) == (1.0, None)  # the mean over steps with a reward
    (extend,) = [s for s in result.info["harbor_steps"]["steps"] if s["name"] == "extend"]
    assert extend["rewards"] is None and "steps/extend/tests/test.sh wrote no reward" in extend["error"]
    nop = run(run_episode(load_harbor_task(task_dir), NopAgent(), backend))
    assert nop.reward.reward == 0.0


def test_verifier_and_solution_env_reach_their_scripts(backend, tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_TEST_HOST_SECRET", "from-host")
    toml = """\
        [verifier.env]
        SHARED = "task"
        FROM_HOST = "${MILES_TEST_HOST_SECRET}"
        DEFAULTED = "${MILES_TEST_SURELY_UNSET:-fallback}"
        [solution.env]
        ANSWER = "42"
        [[steps]]
        name = "only"
        [steps.verifier.env]
        STEP = "mine"
    """
    test_sh = ('#!/bin/bash\necho "$SHARED $FROM_HOST $DEFAULTED $STEP" > /logs/artifacts/verifier-env.txt\n'
               'echo "${ANSWER:-unset}" >> /logs/artifacts/verifier-env.txt\n'
               + check_file("/app/answer.txt", "42").split("\n", 1)[1])
    task_dir = make_task(tmp_path, "env", toml=toml, instruction=None, test_sh=None, solve_sh=None, files={
        "steps/only/instruction.md": "Answer.\n", "steps/only/tests/test.sh": test_sh,
        "steps/only/solution/solve.sh": '#!/bin/bash\necho "$ANSWER" > /app/answer.txt\n'})
    result = run(run_episode(load_harbor_task(task_dir), OracleAgent(), backend))
    assert result.reward.reward == 1.0, result.reward  # solve.sh saw ANSWER=42
    seen = result.info["harbor_steps"]["artifacts"]["only"]["files"]["steps/only/logs/artifacts/verifier-env.txt"]
    assert seen == "task from-host fallback mine\nunset\n"  # [solution.env] does not leak into the verifier


def test_single_step_verifier_env_and_solution_env(backend, tmp_path, monkeypatch):
    monkeypatch.delenv("MILES_TEST_SURELY_UNSET", raising=False)
    toml = '[verifier.env]\nMODE = "${MILES_TEST_SURELY_UNSET:-strict}"\n[solution.env]\nANSWER = "42"\n'
    test_sh = ('#!/bin/bash\n[ "$MODE" = strict ] && [ "$(cat /app/answer.txt)" = 42 ] '
               '&& echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n')
    task_dir = make_task(tmp_path, toml=toml, test_sh=test_sh, solve_sh='#!/bin/bash\necho "$ANSWER" > /app/answer.txt\n')
    result = run(run_episode(load_harbor_task(task_dir), OracleAgent(), backend))
    assert (result.reward.reward, result.reward.error) == (1.0, None)


def test_artifacts_are_copied_out_and_a_missing_one_is_logged(backend, tmp_path, caplog):
    toml = """\
        artifacts = ["/app/answer.txt", "/app/missing.txt", { source = "/app/out", destination = "out", exclude = ["*.log"] }]
    """
    solve = ("#!/bin/bash\necho 42 > /app/answer.txt\nmkdir -p /app/out/sub\necho r > /app/out/sub/report.md\n"
             "echo x > /app/out/noise.log\necho note > /logs/artifacts/note.txt\n")
    task = load_harbor_task(make_task(tmp_path, toml=toml, solve_sh=solve))
    with caplog.at_level("WARNING", logger="miles_env_harbor.artifacts"):
        result = run(run_episode(task, OracleAgent(), backend))
    assert result.reward.reward == 1.0
    artifacts = result.info["artifacts"]
    assert artifacts["files"] == {"/logs/artifacts/note.txt": "note\n", "/app/answer.txt": "42\n",
                                  "out/sub/report.md": "r\n"}
    assert artifacts["missing"] == ["/app/missing.txt"]
    assert "artifact /app/missing.txt does not exist in the sandbox" in caplog.text


def test_multi_step_layout_and_unsupported_modes_are_named(tmp_path):
    task_dir = two_step_task(tmp_path)
    (task_dir / "steps/extend/instruction.md").unlink()
    (task_dir / "steps/write/tests/test.sh").unlink()
    with pytest.raises(TaskFormatError, match=r"two-steps is missing steps/write/tests/test.sh \(or a shared "
                                              r"tests/test.sh\), steps/extend/instruction.md"):
        load_harbor_task(task_dir)
    task_dir = two_step_task(tmp_path / "sep")
    toml = task_dir / "task.toml"
    toml.write_text(toml.read_text() + '[steps.verifier]\nenvironment_mode = "separate"\n')
    with pytest.raises(TaskUnsupportedError, match=r"\[steps.verifier\].environment_mode of step 'extend' = "
                                                   r"'separate' in a multi-step task is not supported yet"):
        load_harbor_task(task_dir)
    toml.write_text('[[steps]]\nname = "a"\n[[steps]]\nname = "a"\n')
    with pytest.raises(TaskFormatError, match="step names must be unique; repeated: a"):
        load_harbor_task(task_dir)


def test_a_step_past_its_agent_time_refuses_tool_calls(backend, tmp_path):
    from miles_env_harbor import steps

    task = load_harbor_task(two_step_task(tmp_path))

    class OverTime:
        name = "over-time"

        async def run(self, ctx):
            first = await ctx.call_tool("bash", {"command": "echo 1 > /app/a"})
            steps.state(ctx).deadline = float("-inf")  # as if the step's 30 s had passed
            late = await ctx.call_tool("bash", {"command": "echo 2 > /app/b"})
            return AgentResult(turns=2, info={"first": first.is_error, "late": late.content})

    result = run(run_episode(task, OverTime(), backend))
    assert result.agent.info == {"first": False, "late": "error: the time for step 'write' (30s) is over; answer "
                                                         "without a tool call to hand the step in"}
    assert result.reward.components["steps.write.reward"] == 1.0 and result.reward.reward == 0.5


def test_a_failing_step_setup_script_ends_the_episode(backend, tmp_path):
    task_dir = two_step_task(tmp_path)
    (task_dir / "steps/extend/workdir").mkdir()
    (task_dir / "steps/extend/workdir/setup.sh").write_text("#!/bin/bash\necho 'no fixture' >&2\nexit 3\n")
    result = run(run_episode(load_harbor_task(task_dir), OracleAgent(), backend))
    steps = result.info["harbor_steps"]
    assert steps["stopped"] == "step 'extend' setup failed"
    assert steps["steps"][1] == {"name": "extend", "rewards": None,
                                 "error": "steps/extend/workdir/setup.sh exited with code 3: no fixture"}
    assert (result.reward.reward, result.reward.error) == (1.0, None)  # the mean over the steps with a reward
    assert "extend" not in result.info["solution"]["steps"]  # its solution never ran


def test_an_unset_host_variable_in_a_step_verifier_env_is_named(backend, tmp_path, monkeypatch):
    monkeypatch.delenv("MILES_TEST_SURELY_UNSET", raising=False)
    task_dir = two_step_task(tmp_path)
    toml = (task_dir / "task.toml").read_text().replace(
        'name = "write"\n', 'name = "write"\n[steps.verifier.env]\nTOKEN = "${MILES_TEST_SURELY_UNSET}"\n')
    (task_dir / "task.toml").write_text(toml)
    result = run(run_episode(load_harbor_task(task_dir), OracleAgent(), backend))
    assert result.reward.reward is None and result.reward.error.startswith(
        "task 'two-steps': no step reward to aggregate (mean): step 'write': task 'two-steps': ")
    assert ("[steps.verifier].env of step 'write': TOKEN = '${MILES_TEST_SURELY_UNSET}' needs host environment "
            "variable MILES_TEST_SURELY_UNSET, which is not set") in result.reward.error
    assert [s["name"] for s in result.info["harbor_steps"]["steps"]] == ["write"]  # the episode stopped there

"""On the local sandbox: a swebench-parser task (oracle 1.0 / no-op 0.0), a set where one task's
parser is unknown (excluded with its reason, the rest validated), and run_tests_in_same_shell."""

from __future__ import annotations

import asyncio

import pytest
from tb_testkit import make_tb_task

from miles_engine.agents.builtin import NopAgent, OracleAgent
from miles_engine.agents.protocol import AgentResult
from miles_engine.environments.admission import admit_on
from miles_engine.environments.protocol import EpisodeContext
from miles_engine.hub import Hub, default_hub, get_plugin_manager
from miles_engine.rollout.episode import run_episode
from miles_engine.rollout.validate import validate_environment
from miles_env_terminal_bench import TerminalBenchSource, load_tb_task

SWEBENCH_YAML = "instruction: Write 42 to /app/answer.txt.\nparser_name: swebench\nmax_test_timeout_sec: 20\n"
# the shape of the SWE-bench adapter's run-tests.sh: the test log, then the harness's verdict between markers
SWEBENCH_RUN_TESTS = """\
#!/bin/bash
echo "+ ./tests/runtests.py --verbosity 2 answer_tests"
if [ "$(cat /app/answer.txt 2>/dev/null)" = "42" ]; then echo "test_answer ... ok"; v=PASSED
else echo "test_answer ... FAIL"; v=FAILED; fi
echo "SWEBench results starts here"
echo "$v"
echo "SWEBench results ends here"
"""
SAME_SHELL_RUN_TESTS = """\
#!/bin/bash
echo "ANSWER=$ANSWER PWD=$PWD"
if [ "$ANSWER" = "42" ] && [ "$PWD" = "/app/work" ]; then v=PASSED; else v=FAILED; fi
printf 'SWEBench results starts here\\n%s\\nSWEBench results ends here\\n' "$v"
"""
SAME_SHELL_SOLUTION = "- command: mkdir -p /app/work && cd /app/work\n- command: export ANSWER=42\n"


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


def swebench_task(root, name="answer"):
    return make_tb_task(root, name, task_yaml=SWEBENCH_YAML, run_tests=SWEBENCH_RUN_TESTS, tests={})


def test_swebench_parser_task_oracle_one_nop_zero(backend, tmp_path):
    d = swebench_task(tmp_path)
    oracle = run(run_episode(load_tb_task(d), OracleAgent(), backend))
    assert (oracle.reward.reward, oracle.reward.error) == (1.0, None), oracle.reward
    assert oracle.reward.info["parsed_from"] == "SWEBench markers"
    nop = run(run_episode(load_tb_task(d), NopAgent(), backend))
    assert (nop.reward.reward, nop.reward.error) == (0.0, None)


def test_a_task_with_an_unknown_parser_is_excluded_and_the_set_goes_on(backend, tmp_path):
    swebench_task(tmp_path, "resolved")
    make_tb_task(tmp_path, "other-parser", task_yaml="instruction: x\nparser_name: formulacode\n")
    source = TerminalBenchSource(tmp_path)
    admission = admit_on(source, "local", backend)
    assert admission.admitted == ["resolved"]
    (excluded,) = admission.excluded
    assert excluded.kind == "unsupported" and "parser_name 'formulacode'" in excluded.reason
    assert "other-parser/task.yaml:2" in excluded.reason
    checks = run(validate_environment(source, backend, hub=default_hub(), task_ids=admission.admitted))
    assert [(c.task_id, c.passed) for c in checks] == [("resolved", True)], checks[0].problems


def same_shell_task(root, same_shell: bool):
    yaml = (f"instruction: Leave ANSWER=42 exported in /app/work.\nparser_name: swebench\n"
            f"run_tests_in_same_shell: {str(same_shell).lower()}\n")
    return make_tb_task(root, f"same-shell-{same_shell}", task_yaml=yaml, run_tests=SAME_SHELL_RUN_TESTS, tests={},
                        solution_sh=None, files={"solution.yaml": SAME_SHELL_SOLUTION})


def test_run_tests_in_same_shell_sees_what_the_agents_shell_left(backend, tmp_path):
    d = same_shell_task(tmp_path, True)
    oracle = run(run_episode(load_tb_task(d), OracleAgent(), backend))
    assert oracle.reward.reward == 1.0, oracle.reward
    assert "ANSWER=42 PWD=/app/work" in oracle.reward.info["test_output_tail"]
    assert run(run_episode(load_tb_task(d), NopAgent(), backend)).reward.reward == 0.0


def test_without_it_the_tests_get_a_fresh_shell(backend, tmp_path):
    d = same_shell_task(tmp_path, False)
    result = run(run_episode(load_tb_task(d), OracleAgent(), backend))
    assert result.reward.reward == 0.0 and "ANSWER= PWD=/app" in result.reward.info["test_output_tail"]


class TwoCalls:
    name = "two-calls"

    def __init__(self) -> None:
        self.outputs: list[str] = []

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        for command in ("mkdir -p /app/work && cd /app/work && export ANSWER=42 && exit 3", 'echo "$ANSWER $PWD"'):
            self.outputs.append((await ctx.call_tool("bash", {"command": command})).content)
        return AgentResult(turns=2)


def test_the_agents_bash_calls_share_one_shell_state(backend, tmp_path):
    agent = TwoCalls()
    result = run(run_episode(load_tb_task(same_shell_task(tmp_path, True)), agent, backend))
    assert "[exit code 3]" in agent.outputs[0] and agent.outputs[1] == "42 /app/work\n"
    assert result.reward.reward == 1.0

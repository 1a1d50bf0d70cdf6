"""Real terminal-bench tasks (real bash, real pytest) on the built-in local sandbox backend.

The sandbox sees the host's filesystem read-only, but not /root (where the venv's interpreter
lives) and Debian's /usr/bin/python3 has no pytest; so ``run-tests.sh`` runs
``/usr/bin/python3 -m pytest`` with this venv's site-packages (pure-Python pytest) on PYTHONPATH.
"""

from __future__ import annotations

import asyncio
import shlex
from pathlib import Path

import pytest
from tb_testkit import make_tb_task

from miles_engine.agents.builtin import NopAgent, OracleAgent
from miles_engine.errors import SandboxUnsupportedError
from miles_engine.hub import Hub, get_plugin_manager
from miles_engine.rollout.episode import run_episode
from miles_env_terminal_bench import load_tb_task

SITE = str(Path(pytest.__file__).resolve().parent.parent)
SANDBOX_PYTHON = "/usr/bin/python3"
PYTEST = f"PYTHONPATH={shlex.quote(SITE)} {SANDBOX_PYTHON} -m pytest -p no:cacheprovider -rA"
RUN_TESTS = f'#!/bin/bash\ncd /app\n{PYTEST} "$TEST_DIR/test_outputs.py"\n'
TESTS = """\
from pathlib import Path

def test_exists():
    assert Path("/app/answer.txt").exists()

def test_value():
    assert Path("/app/answer.txt").read_text().strip() == "42"

def test_no_tests_dir_leak():
    assert Path("/tests/run-tests.sh").exists()
"""

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


@pytest.fixture(scope="module", autouse=True)
def pytest_visible_in_sandbox(backend, tmp_path_factory):
    spec = load_tb_task(make_tb_task(tmp_path_factory.mktemp("probe"))).sandbox_spec()

    async def probe():
        async with await backend.create(spec) as sb:
            return await sb.exec(f"PYTHONPATH={shlex.quote(SITE)} {SANDBOX_PYTHON} -c 'import pytest'", timeout_s=60)

    result = run(probe())
    if not result.ok:
        pytest.skip(f"{SANDBOX_PYTHON} cannot import pytest from {SITE} inside the sandbox: {result.stderr.strip()[-300:]}")


def task_dir(tmp_path, **kw):
    return make_tb_task(tmp_path, run_tests=RUN_TESTS, tests={"test_outputs.py": TESTS}, **kw)


def test_oracle_passes_every_test_and_nop_fails(backend, tmp_path):
    d = task_dir(tmp_path)
    oracle = run(run_episode(load_tb_task(d), OracleAgent(), backend))
    assert (oracle.reward.reward, oracle.reward.error) == (1.0, None), oracle.reward
    assert oracle.reward.components == {"pass_fraction": 1.0, "passed": 3.0, "failed": 0.0}
    assert oracle.reward.info["parsed_from"] == "short-summary"
    nop = run(run_episode(load_tb_task(d), NopAgent(), backend))
    assert nop.reward.reward == 0.0 and nop.reward.components == {"pass_fraction": 1 / 3, "passed": 1.0, "failed": 2.0}


def test_partial_solution_gets_the_pass_fraction(backend, tmp_path):
    d = task_dir(tmp_path, solution_sh="#!/bin/bash\necho 41 > /app/answer.txt\n")
    result = run(run_episode(load_tb_task(d), OracleAgent(), backend))
    assert result.reward.reward == 0.0 and result.reward.components["passed"] == 2.0
    assert {k.rsplit("::", 1)[-1]: v for k, v in result.reward.info["tests"].items()} == {
        "test_exists": "PASSED", "test_value": "FAILED", "test_no_tests_dir_leak": "PASSED"}


def test_solution_yaml_keystrokes_reach_a_program_started_by_an_earlier_line(backend, tmp_path):
    yaml_text = ("- command: cd /app\n- command: python3\n  block: false\n"
                 "- command: open('answer.txt', 'w').write(str(6 * 7))\n- command: exit()\n")
    d = task_dir(tmp_path, solution_sh=None, files={"solution.yaml": yaml_text})
    result = run(run_episode(load_tb_task(d), OracleAgent(), backend))
    assert result.reward.reward == 1.0, result.reward


def test_missing_pytest_output_fails_with_the_task_name(backend, tmp_path):
    d = make_tb_task(tmp_path, run_tests="#!/bin/bash\necho 'pytest: command not found' >&2\nexit 127\n")
    result = run(run_episode(load_tb_task(d), OracleAgent(), backend))
    assert result.reward.reward is None
    assert result.reward.error.startswith("task 'answer': cannot parse the output of run-tests.sh")
    assert "command not found" in result.reward.info["test_output_tail"]


def test_dockerfile_task_is_refused_unless_ignored(backend, tmp_path):
    d = task_dir(tmp_path, files={"Dockerfile": "FROM ghcr.io/laude-institute/t-bench/python-3-13:20250620\n"})
    with pytest.raises(SandboxUnsupportedError, match="Docker build"):
        run(run_episode(load_tb_task(d), OracleAgent(), backend))
    result = run(run_episode(load_tb_task(d, ignore_dockerfile=True), OracleAgent(), backend))
    assert result.reward.reward == 1.0

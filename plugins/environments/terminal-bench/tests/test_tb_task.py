"""TerminalBenchTask and TerminalBenchSource against a fake sandbox; the plugin registration."""

from __future__ import annotations

import asyncio
from importlib.metadata import entry_points

import pytest
from tb_testkit import DEFAULT_SCRIPTS, FakeSandbox, make_tb_task, pytest_like

from miles_engine.environments.protocol import EnvironmentSource, EpisodeContext, NoReferenceSolution, Task, TaskRef
from miles_engine.errors import ConfigError, SandboxUnsupportedError, TaskFormatError, UnknownComponentError
from miles_engine.sandbox.protocol import Capabilities, ExecResult, check_supported
from miles_env_terminal_bench import TerminalBenchSource, load_tb_task
from miles_env_terminal_bench import plugin as tb_plugin

LOCAL_CAPS = Capabilities(isolation="namespace", network_modes=frozenset({"none"}), absolute_paths=True)


def run(coro):
    return asyncio.run(coro)


def episode(task, scripts=None):
    sb = FakeSandbox(task.sandbox_spec(), dict(DEFAULT_SCRIPTS, **(scripts or {})))
    ctx = EpisodeContext(task=task, sandbox=sb)
    run(task.setup(ctx))
    return sb, ctx


def test_prompt_limits_metadata_and_spec(tmp_path):
    task = load_tb_task(make_tb_task(tmp_path))
    assert isinstance(task, Task)
    assert task.prompt() == [{"role": "user", "content": "Write 42 to /app/answer.txt.\n"}]
    assert (task.limits.agent_timeout_s, task.limits.verifier_timeout_s) == (50.0, 50.0)
    assert task.metadata["difficulty"] == "easy" and task.metadata["tags"] == ["files", "demo"]
    spec = task.sandbox_spec()
    assert spec.build is None and spec.image is None and spec.workdir == "/app" and spec.network.mode == "none"
    check_supported(spec, LOCAL_CAPS, backend="local")


def test_dockerfile_is_a_build_refused_by_the_local_backend_unless_ignored(tmp_path):
    task_dir = make_tb_task(tmp_path, files={"Dockerfile": "FROM ghcr.io/laude-institute/t-bench/python-3-13\n",
                                             "docker-compose.yaml": "services:\n  client:\n    build: {context: .}\n"})
    spec = load_tb_task(task_dir).sandbox_spec()
    assert spec.build is not None and spec.build.context_dir == task_dir
    with pytest.raises(SandboxUnsupportedError, match=r"cannot run task 'answer'.*a Docker build of .*answer/Dockerfile"):
        check_supported(spec, LOCAL_CAPS, backend="local", task="answer")
    plain = load_tb_task(task_dir, ignore_dockerfile=True).sandbox_spec()
    assert plain.build is None
    check_supported(plain, LOCAL_CAPS, backend="local")


def test_multi_service_compose_gives_sidecars_refused_by_backends_without_them(tmp_path):
    compose = "services:\n  client:\n    build: .\n  db:\n    image: postgres\n"
    task = load_tb_task(make_tb_task(tmp_path, files={"Dockerfile": "FROM x\n", "docker-compose.yaml": compose}))
    spec = task.sandbox_spec()
    assert [(sv.name, sv.image) for sv in spec.services] == [("db", "postgres")]
    with pytest.raises(SandboxUnsupportedError, match=r"needs .*sidecar services db \(Docker Compose\)"):
        check_supported(spec, LOCAL_CAPS, backend="local")
    with pytest.raises(TaskFormatError, match=r"docker-compose\.yaml: field 'services'"):
        load_tb_task(make_tb_task(tmp_path, "t2", files={"docker-compose.yaml": "services: 3\n"}))


def test_oracle_scores_one_nop_scores_zero_and_tests_arrive_only_at_verify(tmp_path):
    task = load_tb_task(make_tb_task(tmp_path))
    sb, ctx = episode(task)
    run(task.solve(ctx))
    assert sb.under("/tests") == [], "tests must not be visible to the agent"
    assert sb.text("/solution/solution.sh").startswith("#!/bin/bash")
    result = run(task.verify(ctx))
    assert result.reward == 1.0 and result.error is None
    assert result.components == {"pass_fraction": 1.0, "passed": 1.0, "failed": 0.0}
    assert sb.under("/tests") == ["/tests/run-tests.sh", "/tests/test_outputs.py"]
    run_call = next(c for c in sb.calls if "run-tests.sh" in c["cmd"])
    assert (run_call["env"], run_call["timeout_s"]) == ({"TEST_DIR": "/tests"}, 20.0)
    _, ctx2 = episode(task)
    nop = run(task.verify(ctx2))
    assert nop.reward == 0.0 and nop.components["failed"] == 1.0


def test_partial_pass_gives_zero_reward_and_the_fraction(tmp_path):
    task = load_tb_task(make_tb_task(tmp_path))
    _, ctx = episode(task, {"/tests/run-tests.sh": lambda sb, call: pytest_like(3, 1)})
    result = run(task.verify(ctx))
    assert result.reward == 0.0 and result.components == {"pass_fraction": 0.75, "passed": 3.0, "failed": 1.0}


@pytest.mark.parametrize("output", ["", "bash: pytest: command not found\n"])
def test_unparseable_output_fails_naming_the_task(tmp_path, output):
    task = load_tb_task(make_tb_task(tmp_path))
    _, ctx = episode(task, {"/tests/run-tests.sh": lambda sb, call: ExecResult(127, "", output)})
    result = run(task.verify(ctx))
    assert result.reward is None and result.error.startswith("task 'answer': cannot parse the output of run-tests.sh")
    assert result.info["test_output_tail"] == output


def test_test_timeout_fails(tmp_path):
    task = load_tb_task(make_tb_task(tmp_path))
    _, ctx = episode(task, {"/tests/run-tests.sh": lambda sb, call: ExecResult(None, "", "", timed_out=True)})
    assert run(task.verify(ctx)).error == "task 'answer': run-tests.sh timed out after 20s"


def test_stale_test_output_is_removed(tmp_path):
    task = load_tb_task(make_tb_task(tmp_path))
    sb, ctx = episode(task, {"/tests/run-tests.sh": lambda sb, call: ExecResult(1, "", "")})
    sb.files["/logs/tests-output.txt"] = pytest_like(5, 0).encode()  # planted by the agent
    sb.files["/tests/run-tests.sh"] = b"echo fake pass"  # overwritten by the task's own script
    result = run(task.verify(ctx))
    assert result.reward is None and "cannot parse" in result.error


def test_solution_yaml_is_fed_to_one_shell(tmp_path):
    task_dir = make_tb_task(tmp_path, solution_sh=None, files={
        "solution.yaml": "- command: cd /app\n- command: python3\n  block: false\n- command: print(6*7)\n- command: exit()\n"})
    task = load_tb_task(task_dir)
    sb, ctx = episode(task, {"-s": lambda sb, call: "42\n"})
    run(task.solve(ctx))
    assert sb.calls[-1]["cmd"] == "bash -s" and sb.calls[-1]["stdin"] == b"cd /app\npython3\nprint(6*7)\nexit()\n"
    assert ctx.info["solution"]["exit_code"] == 0


def test_solution_yaml_with_tmux_keys_is_refused(tmp_path):
    task_dir = make_tb_task(tmp_path, solution_sh=None, files={
        "solution.yaml": "- command: vim x\n- command: Escape\n  append_enter: false\n"})
    _, ctx = episode(load_tb_task(task_dir))
    with pytest.raises(NoReferenceSolution, match="tmux key 'Escape'"):
        run(load_tb_task(task_dir).solve(ctx))


def test_no_solution(tmp_path):
    task = load_tb_task(make_tb_task(tmp_path, solution_sh=None))
    _, ctx = episode(task)
    with pytest.raises(NoReferenceSolution, match="no solution.sh or solution.yaml"):
        run(task.solve(ctx))


# -- source ------------------------------------------------------------------------------------
def test_source_lists_lazily_and_loads(tmp_path):
    make_tb_task(tmp_path, "b")
    make_tb_task(tmp_path, "a", task_yaml="instruction: x\ndifficulty: hard\ntags: [t]\ncategory: games\n")
    (tmp_path / "not-a-task").mkdir()
    source = TerminalBenchSource(tmp_path)
    assert isinstance(source, EnvironmentSource) and source.name == "terminal-bench"
    assert next(source.list_tasks()) == TaskRef(id="a", difficulty="hard", tags=("t",), description="games")
    assert source.task_ids() == ["a", "b"]
    assert source.load_task("b").id == "b"
    assert TerminalBenchSource(tmp_path, exclude=["a"]).task_ids() == ["b"]
    assert TerminalBenchSource(tmp_path / "a").task_ids() == ["a"]


@pytest.mark.parametrize(("kwargs", "missing"), [({"run_tests": None}, "run-tests.sh")])
def test_missing_parts_are_named(tmp_path, kwargs, missing):
    make_tb_task(tmp_path, "broken", **kwargs)
    with pytest.raises(TaskFormatError, match=rf"terminal-bench task .*broken is missing {missing}$"):
        TerminalBenchSource(tmp_path).load_task("broken")


def test_tests_must_be_a_directory(tmp_path):
    task_dir = make_tb_task(tmp_path, tests={})
    (task_dir / "tests").write_text("oops")
    with pytest.raises(TaskFormatError, match="tests must be a directory"):
        load_tb_task(task_dir)


def test_malformed_yaml_lists_but_fails_at_load(tmp_path):
    make_tb_task(tmp_path, "bad", task_yaml="instruction: x\nmax_test_timeout_sec: soon\n")
    source = TerminalBenchSource(tmp_path)
    assert [r.id for r in source.list_tasks()] == ["bad"]
    with pytest.raises(TaskFormatError, match=r"bad/task\.yaml:2: bad value for 'max_test_timeout_sec'"):
        source.load_task("bad")


def test_unknown_task_id(tmp_path):
    make_tb_task(tmp_path, "hello-world")
    with pytest.raises(UnknownComponentError, match=r"unknown task 'hello-wrld' in environment 'terminal-bench' \(did you mean 'hello-world'\?\); available \(1\): hello-world"):
        TerminalBenchSource(tmp_path).load_task("hello-wrld")


def test_plugin_registration_and_options(tmp_path):
    from miles_engine.hub import validate_options

    make_tb_task(tmp_path, "t")
    (comp,) = tb_plugin.miles_register_environments()
    assert comp.name == "terminal-bench"
    opts = validate_options(comp, {"path": str(tmp_path), "ignore_dockerfile": True}, where="environment 'terminal-bench'")
    source = comp.factory(opts)
    assert source.ignore_dockerfile and source.task_ids() == ["t"]
    with pytest.raises(ConfigError, match="network"):
        validate_options(comp, {"path": "x", "network": "lan"}, where="environment 'terminal-bench'")
    assert {ep.name: ep.value for ep in entry_points(group="miles")}.get("terminal-bench") == "miles_env_terminal_bench.plugin"

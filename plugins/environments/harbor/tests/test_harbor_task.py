"""HarborTask against a fake sandbox: spec mapping, setup/solve, and Harbor's verification protocol."""

from __future__ import annotations

import asyncio
import json

import pytest
from harbor_testkit import DEFAULT_SCRIPTS, DEFAULT_TOML, FakeFactory, FakeSandbox, make_task

from miles_engine.environments.protocol import EpisodeContext, NoReferenceSolution
from miles_engine.errors import SandboxUnsupportedError
from miles_engine.sandbox.protocol import Capabilities, ExecResult, check_supported
from miles_env_harbor import SANDBOX_FACTORY_KEY, load_harbor_task
from miles_env_harbor.task import VERIFY_GRACE_S

LOCAL_CAPS = Capabilities(isolation="namespace", network_modes=frozenset({"none"}), absolute_paths=True)


def run(coro):
    return asyncio.run(coro)


def episode(task, scripts=None, **info):
    sb = FakeSandbox(task.sandbox_spec(), dict(DEFAULT_SCRIPTS, **(scripts or {})))
    ctx = EpisodeContext(task=task, sandbox=sb, info=dict(info))
    run(task.setup(ctx))
    return sb, ctx


# -- prompt, limits, sandbox spec ------------------------------------------------------------
def test_prompt_limits_and_metadata(tmp_path):
    task = load_harbor_task(make_task(tmp_path))
    assert task.prompt() == [{"role": "user", "content": "Write 42 to /app/answer.txt.\n"}]
    assert task.limits.agent_timeout_s == 30.0 and task.limits.verifier_timeout_s == 20.0 + VERIFY_GRACE_S
    assert task.limits.command_timeout_s == 30.0
    assert [t.name for t in task.tools()] == ["bash"]
    assert task.metadata | {"path": None} == {
        "source": "harbor", "path": None, "format": "harbor", "schema_version": "1.4", "difficulty": "easy",
        "category": "files", "tags": ["demo"], "verifier_mode": "shared"}


def test_plain_task_spec_runs_on_default_userland(tmp_path):
    spec = load_harbor_task(make_task(tmp_path)).sandbox_spec()
    assert spec.image is None and spec.build is None
    assert spec.workdir == "/app" and spec.paths == ("/app", "/logs", "/tests", "/solution")
    assert spec.network.mode == "none" and spec.resources.cpus is None and spec.user is None
    assert spec.labels == {"miles.source": "harbor", "miles.task": "answer", "miles.role": "agent"}
    check_supported(spec, LOCAL_CAPS, backend="local")  # nothing a namespace sandbox lacks


def test_environment_section_maps_onto_the_spec(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_TEST_TOKEN", "tok")
    toml = """\
        [agent]
        user = "agent"
        [environment]
        docker_image = "acme/img:1"
        cpus = 2
        memory = "1G"
        storage_mb = 500
        gpus = 1
        workdir = "/workspace"
        env = { A = "1", T = "${MILES_TEST_TOKEN}" }
        network_mode = "allowlist"
        allowed_hosts = ["pypi.org"]
        """
    spec = load_harbor_task(make_task(tmp_path, toml=toml)).sandbox_spec()
    assert spec.image == "acme/img:1" and spec.build is None
    assert spec.workdir == "/workspace" and spec.paths[-1] == "/workspace"
    assert (spec.resources.cpus, spec.resources.memory_mb, spec.resources.disk_mb, spec.resources.gpus) == (2, 1024, 500, 1)
    assert dict(spec.env) == {"A": "1", "T": "tok"}
    assert spec.network.mode == "allowlist" and spec.network.allowed_hosts == ("pypi.org",)
    assert spec.user == "agent"


@pytest.mark.parametrize(("toml", "mode"), [("[environment]\nallow_internet = true\n", "public"),
                                            ("[environment]\nallow_internet = false\n", "none"),
                                            ('[environment]\nnetwork_mode = "public"\n[agent]\nnetwork_mode = "no-network"\n', "none")])
def test_network_declarations(tmp_path, toml, mode):
    assert load_harbor_task(make_task(tmp_path, toml=toml)).sandbox_spec().network.mode == mode


def test_default_network_option(tmp_path):
    task = load_harbor_task(make_task(tmp_path), default_network="public")
    assert task.sandbox_spec().network.mode == "public"


def test_docker_image_task_is_refused_with_a_clear_message(tmp_path):
    task = load_harbor_task(make_task(tmp_path, toml='[environment]\ndocker_image = "ubuntu:24.04"\n'))
    with pytest.raises(SandboxUnsupportedError, match="backend 'local' cannot run task 'answer'.*container image 'ubuntu:24.04'"):
        check_supported(task.sandbox_spec(), LOCAL_CAPS, backend="local", task=task.id)


def test_dockerfile_becomes_a_build_and_is_refused(tmp_path):
    task_dir = make_task(tmp_path, files={"environment/Dockerfile": "FROM ubuntu:24.04\n"})
    spec = load_harbor_task(task_dir).sandbox_spec()
    assert spec.build is not None and spec.build.context_dir == task_dir / "environment"
    with pytest.raises(SandboxUnsupportedError, match=r"a Docker build of .*environment/Dockerfile"):
        check_supported(spec, LOCAL_CAPS, backend="local")
    plain = load_harbor_task(task_dir, ignore_dockerfile=True).sandbox_spec()
    assert plain.build is None and plain.image is None


def test_compose_only_environment_is_refused(tmp_path):
    task = load_harbor_task(make_task(tmp_path, files={"environment/docker-compose.yaml": "services: {}\n"}))
    with pytest.raises(SandboxUnsupportedError, match="Docker Compose"):
        task.sandbox_spec()


def test_compose_limits_go_to_sidecars_and_fill_in_mains_unset_resources_and_environment(tmp_path):
    from miles_engine.sandbox.protocol import Resources

    overlay = ("services:\n  main:\n    cpus: 3\n    mem_limit: 2g\n    ports: ['8080:80']\n"
               "    environment: {DB_HOST: db, DB_PORT: '5432'}\n"
               "  db:\n    image: postgres:16\n    mem_limit: 128m\n    pids_limit: 40\n")
    toml = DEFAULT_TOML + "\n[environment]\ncpus = 2\n"
    task = load_harbor_task(make_task(tmp_path, toml=toml, files={
        "environment/Dockerfile": "FROM ubuntu:24.04\n", "environment/docker-compose.yaml": overlay}))
    spec = task.sandbox_spec()
    assert (spec.resources.cpus, spec.resources.memory_mb) == (2, 2048)  # task.toml's cpus win; compose fills memory
    assert spec.env["DB_HOST"] == "db" and spec.env["DB_PORT"] == "5432"  # main's environment reaches the agent
    (db,) = spec.services
    assert (db.resources, db.pids_limit) == (Resources(memory_mb=128), 40)


# -- setup and the reference solution --------------------------------------------------------
def test_setup_creates_log_dirs_and_hides_tests_and_solution(tmp_path):
    task = load_harbor_task(make_task(tmp_path))
    sb, _ = episode(task)
    assert sb.commands() == ["mkdir -p /logs/agent /logs/verifier /logs/artifacts"]
    assert sb.under("/tests") == [] and sb.under("/solution") == []


def test_solve_uploads_solution_and_runs_it(tmp_path):
    task = load_harbor_task(make_task(tmp_path, toml='[solution]\nenv = { HINT = "h" }\n[agent]\ntimeout_sec = 9\n'))
    sb, ctx = episode(task)
    run(task.solve(ctx))
    assert sb.under("/solution") == ["/solution/solve.sh"] and sb.text("/app/answer.txt") == "42\n"
    call = sb.calls[-1]
    assert (call["cmd"], call["env"], call["timeout_s"]) == ("bash /solution/solve.sh", {"HINT": "h"}, 9.0)
    assert ctx.info["solution"]["exit_code"] == 0 and sb.under("/tests") == []


def test_no_solution_raises_no_reference_solution(tmp_path):
    task = load_harbor_task(make_task(tmp_path, solve_sh=None))
    _, ctx = episode(task)
    with pytest.raises(NoReferenceSolution, match="task 'answer' has no reference solution"):
        run(task.solve(ctx))


# -- verification ----------------------------------------------------------------------------
def test_oracle_scores_one_and_nop_scores_zero(tmp_path):
    task = load_harbor_task(make_task(tmp_path))
    sb, ctx = episode(task)
    run(task.solve(ctx))
    result = run(task.verify(ctx))
    assert (result.reward, result.error, result.components) == (1.0, None, {"reward": 1.0})
    assert result.info["reward_file"] == "/logs/verifier/reward.txt" and result.info["test_exit_code"] == 0
    assert sb.text("/logs/verifier/test-stdout.txt") == "checked\n"
    _, ctx2 = episode(task)
    assert run(task.verify(ctx2)).reward == 0.0


def test_verification_order_and_tests_uploaded_only_then(tmp_path):
    task = load_harbor_task(make_task(tmp_path, files={"tests/helper.py": "x = 1\n"}))
    sb, ctx = episode(task)
    seen_before: list[str] = []

    def spy(box, env):
        seen_before.extend(box.under("/tests"))
        return DEFAULT_SCRIPTS["/tests/test.sh"](box, env)

    sb.scripts["/tests/test.sh"] = spy
    assert sb.under("/tests") == []
    result = run(task.verify(ctx))
    assert result.reward == 0.0 and result.info["test_stdout_tail"] == "checked\n"  # why it scored 0
    assert seen_before == ["/tests/helper.py", "/tests/test.sh"]
    assert sb.commands()[1:] == [
        "mkdir -p /logs/verifier /tests && rm -f /logs/verifier/reward.json /logs/verifier/reward.txt /logs/verifier/test-stdout.txt",
        "bash /tests/test.sh > /logs/verifier/test-stdout.txt 2>&1",
        'for f in /logs/verifier/reward.json /logs/verifier/reward.txt; do if [ -f "$f" ]; then echo "$f"; fi; done',
        "tail -c 2000 /logs/verifier/test-stdout.txt 2>/dev/null || true",
    ]


def test_stale_reward_from_a_previous_run_is_removed(tmp_path):
    task = load_harbor_task(make_task(tmp_path))
    sb, ctx = episode(task, scripts={"/tests/test.sh": lambda box, env: "forgot to write a reward\n"})
    sb.files["/logs/verifier/reward.txt"] = b"1\n"  # planted by the agent or left by an earlier run
    sb.files["/logs/verifier/reward.json"] = b'{"reward": 1}'
    result = run(task.verify(ctx))
    assert result.reward is None
    assert "task 'answer': tests/test.sh wrote no reward (neither /logs/verifier/reward.json nor" in result.error
    assert result.info["test_stdout_tail"] == "forgot to write a reward\n"


def _writes(path: str, data: bytes):
    def script(box, env):
        box.files[path] = data
    return script


@pytest.mark.parametrize(
    ("path", "data", "needle"),
    [("/logs/verifier/reward.txt", b"", "reward.txt: reward file is empty"),
     ("/logs/verifier/reward.txt", b"PASSED\n", "reward.txt: reward file does not hold one number: 'PASSED'"),
     ("/logs/verifier/reward.txt", b"nan\n", "reward.txt: reward 'reward' is nan"),
     ("/logs/verifier/reward.json", b'{"reward": "high"}', "reward.json: reward 'reward' must be a number, got str"),
     ("/logs/verifier/reward.json", b"not json", "reward.json: reward file is not valid JSON")],
)
def test_bad_reward_files_fail_the_sample_naming_task_and_file(tmp_path, path, data, needle):
    task = load_harbor_task(make_task(tmp_path))
    _, ctx = episode(task, scripts={"/tests/test.sh": _writes(path, data)})
    result = run(task.verify(ctx))
    assert result.reward is None and result.error.startswith("task 'answer': /logs/verifier/")
    assert needle in result.error


def test_reward_json_wins_over_txt(tmp_path):
    def both(box, env):
        box.files["/logs/verifier/reward.txt"] = b"0"
        box.files["/logs/verifier/reward.json"] = json.dumps({"correct": 1, "style": 0.5}).encode()

    task = load_harbor_task(make_task(tmp_path))
    _, ctx = episode(task, scripts={"/tests/test.sh": both})
    result = run(task.verify(ctx))
    assert result.reward == 0.75 and result.components == {"correct": 1.0, "style": 0.5}
    assert result.info["reward_file"] == "/logs/verifier/reward.json"


def test_verifier_env_user_and_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_JUDGE_KEY", "k")
    toml = '[verifier]\ntimeout_sec = 7\nuser = "root"\nenv = { MODE = "strict", KEY = "${MILES_JUDGE_KEY}" }\n'
    task = load_harbor_task(make_task(tmp_path, toml=toml))
    sb, ctx = episode(task)
    run(task.verify(ctx))
    call = next(c for c in sb.calls if c["cmd"].startswith("bash /tests/test.sh"))
    assert (call["env"], call["timeout_s"], call["user"]) == ({"MODE": "strict", "KEY": "k"}, 7.0, "root")


def test_missing_verifier_env_variable_fails_the_sample(tmp_path, monkeypatch):
    monkeypatch.delenv("MILES_NOT_SET", raising=False)
    task = load_harbor_task(make_task(tmp_path, toml='[verifier]\nenv = { K = "${MILES_NOT_SET}" }\n'))
    _, ctx = episode(task)
    result = run(task.verify(ctx))
    assert result.reward is None and "MILES_NOT_SET, which is not set" in result.error


def test_test_script_timeout_fails_the_sample(tmp_path):
    task = load_harbor_task(make_task(tmp_path))
    _, ctx = episode(task, scripts={"/tests/test.sh": lambda box, env: ExecResult(None, "", "", timed_out=True)})
    result = run(task.verify(ctx))
    assert result.reward is None and result.error == "task 'answer': tests/test.sh timed out after 20s"


# -- separate verifier mode ------------------------------------------------------------------
SEPARATE = """\
artifacts = ["/app/answer.txt", "/app/missing.txt"]
[verifier]
environment_mode = "separate"
[verifier.environment]
docker_image = "acme/verifier:1"
"""


def test_separate_mode_verifies_in_a_fresh_sandbox_with_artifacts(tmp_path):
    task = load_harbor_task(make_task(tmp_path, toml=SEPARATE))
    factory = FakeFactory(DEFAULT_SCRIPTS)
    sb, ctx = episode(task, **{SANDBOX_FACTORY_KEY: factory})
    run(task.solve(ctx))
    sb.files["/logs/artifacts/log.txt"] = b"agent log"
    result = run(task.verify(ctx))
    assert result.reward == 1.0 and result.info["verifier_mode"] == "separate"
    assert result.info["artifacts"] == ["/logs/artifacts", "/app/answer.txt"]
    (vsb,) = factory.created
    assert vsb.spec.image == "acme/verifier:1" and vsb.spec.labels["miles.role"] == "verifier"
    assert vsb.text("/app/answer.txt") == "42\n" and vsb.text("/logs/artifacts/log.txt") == "agent log"
    assert vsb.under("/tests") == ["/tests/test.sh"] and vsb.closed == 1
    assert sb.under("/tests") == [], "the agent's sandbox never receives the tests"


def test_separate_mode_without_answer_scores_zero(tmp_path):
    task = load_harbor_task(make_task(tmp_path, toml=SEPARATE))
    factory = FakeFactory(DEFAULT_SCRIPTS)
    _, ctx = episode(task, **{SANDBOX_FACTORY_KEY: factory})
    assert run(task.verify(ctx)).reward == 0.0 and factory.created[0].closed == 1


def test_separate_mode_without_factory_is_a_clear_error(tmp_path):
    task = load_harbor_task(make_task(tmp_path, toml=SEPARATE))
    _, ctx = episode(task)
    result = run(task.verify(ctx))
    assert result.reward is None
    assert "sets [verifier].environment_mode = 'separate'" in result.error and "sandbox_factory" in result.error


def test_separate_spec_defaults_to_a_copy_of_the_environment(tmp_path):
    toml = '[verifier]\nenvironment_mode = "separate"\nnetwork_mode = "public"\n[environment]\ndocker_image = "a:1"\ncpus = 2\n'
    task = load_harbor_task(make_task(tmp_path, toml=toml, files={"tests/Dockerfile": "FROM a:1\n"}))
    spec = task.verifier_sandbox_spec()
    assert spec.image == "a:1" and spec.resources.cpus == 2 and spec.network.mode == "public"
    task2 = load_harbor_task(make_task(tmp_path, "t2", toml='[verifier]\nenvironment_mode = "separate"\n',
                                       files={"tests/Dockerfile": "FROM b\n"}))
    assert task2.verifier_sandbox_spec().build.context_dir == task2.tests_dir


def test_episode_runner_hands_the_separate_verifier_a_factory(tmp_path):
    from miles_engine.agents.builtin import OracleAgent
    from miles_engine.rollout.episode import run_episode

    class FakeBackend:
        name = "fake"

        def __init__(self):
            self.factory = FakeFactory(DEFAULT_SCRIPTS)

        def capabilities(self):
            return LOCAL_CAPS

        async def create(self, spec):
            return await self.factory(spec)

        async def aclose(self):
            return None

    backend = FakeBackend()
    result = run(run_episode(load_harbor_task(make_task(tmp_path, toml=SEPARATE)), OracleAgent(), backend))
    assert (result.reward.reward, result.reward.error) == (1.0, None)
    agent_sb, verifier_sb = backend.factory.created
    assert agent_sb.closed >= 1 and verifier_sb.closed == 1 and verifier_sb.spec.labels["miles.role"] == "verifier"

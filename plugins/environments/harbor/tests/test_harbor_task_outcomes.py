"""Per-task outcomes on a Harbor set: one task the backend cannot run (a GPU, an image) or that the
reader does not support (an unknown schema_version) is excluded with its own reason; the rest go on."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from harbor_testkit import make_task

from miles_engine.cli.main import cli
from miles_engine.environments.admission import admit_tasks
from miles_engine.errors import SandboxUnsupportedError
from miles_engine.hub import Hub, get_plugin_manager
from miles_engine.sandbox.protocol import Capabilities, check_supported
from miles_env_harbor import HarborSource

LOCAL_CAPS = Capabilities(isolation="namespace", network_modes=frozenset({"none", "public"}), absolute_paths=True)
DOCKER_WITHOUT_GPUS = Capabilities(isolation="container", network_modes=frozenset({"none", "public"}), images=True,
                                   dockerfile_build=True, absolute_paths=True, run_as_user=True, services=True)
GPU_TOML = 'schema_version = "1.4"\n[environment]\ngpus = 1\n'
FUTURE_TOML = 'schema_version = "2.0"\n'


def mixed_set(root):
    make_task(root, "good")
    make_task(root, "needs-gpu", toml=GPU_TOML)
    make_task(root, "future-schema", toml=FUTURE_TOML)
    make_task(root, "ubuntu-image", toml='[environment]\ndocker_image = "ubuntu:24.04"\n')
    make_task(root, "no-test", test_sh=None)
    return HarborSource(root)


def remedy_of(reason: str) -> str:
    return reason.split("what would run it:", 1)[1]


def test_each_task_gets_its_own_outcome(tmp_path):
    admission = admit_tasks(mixed_set(tmp_path), "local", LOCAL_CAPS)
    assert admission.admitted == ["good"]
    by_id = {e.task_id: e for e in admission.excluded}
    assert {i: e.kind for i, e in by_id.items()} == {
        "needs-gpu": "backend", "future-schema": "unsupported", "ubuntu-image": "backend", "no-test": "malformed"}
    gpu = by_id["needs-gpu"].reason
    assert f"{tmp_path / 'needs-gpu' / 'task.toml'} [environment].gpus = 1" in gpu and "1 GPU(s)" in gpu
    assert "docker (sandbox option gpus=true" in remedy_of(gpu) and "local" not in remedy_of(gpu)
    assert "[environment].docker_image = 'ubuntu:24.04'" in by_id["ubuntu-image"].reason
    future = by_id["future-schema"].reason  # one error: the file, the line, the key, the value, what we know
    assert future == (f"{tmp_path / 'future-schema' / 'task.toml'}:1: schema_version = '2.0' is a task schema this "
                      f"reader does not know; this reader knows schema_version 1.0, 1.1, 1.2, 1.3, 1.4 (and reads "
                      f"a later 1.x as 1.4)")
    assert "missing tests/test.sh" in by_id["no-test"].reason
    assert admission.metrics()["environment/tasks_excluded"] == 4.0
    assert admission.metrics()["environment/tasks_excluded/backend"] == 2.0
    assert "4 of 5 task(s) excluded on sandbox backend 'local'" in admission.summary()


def test_the_backend_in_use_is_never_the_remedy(tmp_path):
    make_task(tmp_path, "needs-gpu", toml=GPU_TOML)
    source = HarborSource(tmp_path)
    (excluded,) = admit_tasks(source, "docker", DOCKER_WITHOUT_GPUS).excluded
    remedy = remedy_of(excluded.reason)
    assert "docker" not in remedy and "modal (sandbox option gpu=<type>)" in remedy
    assert "on this backend, sandbox option gpus=true" in remedy
    with pytest.raises(SandboxUnsupportedError) as err:
        check_supported(source.load_task("needs-gpu").sandbox_spec(), DOCKER_WITHOUT_GPUS, backend="docker")
    assert "docker" not in str(err.value).split("What would run it:", 1)[1]


def invoke(*args: str):
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_env_tasks_reports_each_outcome(tmp_path):
    mixed_set(tmp_path)
    code, out, _ = invoke("env", "tasks", "harbor", "--path", str(tmp_path), "--json")
    rows = {r["id"]: r for r in json.loads(out)}
    assert code == 0 and rows["good"]["status"] == "ok" and rows["good"]["reason"] is None
    assert rows["needs-gpu"]["status"] == "excluded: backend" and "[environment].gpus = 1" in rows["needs-gpu"]["reason"]
    assert rows["future-schema"]["status"] == "excluded: unsupported"
    code, out, _ = invoke("env", "tasks", "harbor", "--path", str(tmp_path), "--no-check", "--json")
    assert code == 0 and {r["status"] for r in json.loads(out)} == {"unchecked"}


@pytest.fixture
def namespaced_local():
    caps = Hub(get_plugin_manager(load_entrypoints=False)).create("sandbox", "local").capabilities()
    if not (caps.absolute_paths and "none" in caps.network_modes):
        pytest.skip(f"the local sandbox achieves only '{caps.isolation}' isolation here: no task paths")


def test_env_validate_checks_the_rest_of_the_set(tmp_path, namespaced_local):
    make_task(tmp_path, "good")
    make_task(tmp_path, "needs-gpu", toml=GPU_TOML)
    make_task(tmp_path, "future-schema", toml=FUTURE_TOML)
    code, out, err = invoke("env", "validate", "harbor", "--path", str(tmp_path), "--json")
    report = json.loads(out)
    assert code == 0, err
    assert [(t["task"], t["passed"]) for t in report["tasks"]] == [("good", True)]
    assert {e["task"]: e["kind"] for e in report["excluded"]} == {"needs-gpu": "backend", "future-schema": "unsupported"}
    code, out, err = invoke("env", "validate", "harbor", "--path", str(tmp_path))
    assert code == 0 and "1/1 tasks passed, 2 excluded" in out and "needs-gpu [backend]" in out


def test_env_validate_fails_when_nothing_can_run(tmp_path, namespaced_local):
    make_task(tmp_path, "needs-gpu", toml=GPU_TOML)
    code, _, err = invoke("env", "validate", "harbor", "--path", str(tmp_path), "--json")
    assert code == 1 and "no task that backend 'local' can run" in err


def test_a_malformed_task_still_fails_validation(tmp_path, namespaced_local):
    make_task(tmp_path, "good")
    make_task(tmp_path, "no-test", test_sh=None)
    code, out, err = invoke("env", "validate", "harbor", "--path", str(tmp_path), "--json")
    problems = {t["task"]: t["problems"] for t in json.loads(out)["tasks"]}
    assert code == 1 and "no-test" in err and problems["good"] == []
    assert "missing tests/test.sh" in " ".join(problems["no-test"])


def startup(tmp_path, source):
    """The training run's start-up: the task stream it would train on, and its metrics rows."""
    from miles_engine.config import load_recipe
    from miles_engine.hub import default_hub
    from miles_engine.metrics import MetricsLogger
    from miles_engine.run.compose import _runnable_tasks

    cfg = load_recipe("tiny-terminal", [], hub=default_hub())
    backend = Hub(get_plugin_manager(load_entrypoints=False)).create("sandbox", "local")
    with MetricsLogger(tmp_path / "run") as metrics:
        stream = _runnable_tasks(cfg, source, backend, metrics)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return stream, rows


def test_training_states_what_it_left_out_and_trains_on_the_rest(tmp_path, capsys, namespaced_local):
    stream, rows = startup(tmp_path, mixed_set(tmp_path / "tasks"))
    assert [r.id for r in stream.refs] == ["good"]
    (row,) = [r for r in rows if r["kind"] == "environment"]
    assert row["environment/tasks_excluded"] == 4 and row["environment/tasks_admitted"] == 1
    assert row["environment/tasks_excluded/unsupported"] == 1
    out = capsys.readouterr().out
    assert "4 of 5 task(s) excluded on sandbox backend 'local'" in out and "needs-gpu [backend]" in out


def test_training_refuses_only_when_nothing_is_left(tmp_path, namespaced_local):
    make_task(tmp_path / "tasks", "needs-gpu", toml=GPU_TOML)
    with pytest.raises(SandboxUnsupportedError, match=r"nothing to train on: .*1 of 1 task\(s\) excluded"):
        startup(tmp_path, HarborSource(tmp_path / "tasks"))


def test_a_file_where_a_task_directory_is_read_is_one_clear_error(tmp_path):
    from miles_engine.errors import TaskFormatError

    (tmp_path / "rows.jsonl").write_text("{}\n")
    with pytest.raises(TaskFormatError, match=r"rows.jsonl is a file; this environment reads a directory of task "
                                              r"directories, or one task directory \(holding task.toml\)"):
        invoke("env", "tasks", "harbor", "--path", str(tmp_path / "rows.jsonl"))


def test_eval_leaves_out_only_the_tasks_the_backend_cannot_run(tmp_path, capsys):
    from types import SimpleNamespace

    from miles_engine.evaluation.splits import EvalTasks, runnable_eval_tasks

    source = mixed_set(tmp_path)
    backend = SimpleNamespace(capabilities=lambda: LOCAL_CAPS)
    tasks = runnable_eval_tasks(EvalTasks(source, source.task_ids(), "no split", 5), "local", backend)
    assert tasks.ids == ["good"] and {e.task_id for e in tasks.excluded} == {
        "needs-gpu", "future-schema", "ubuntu-image", "no-test"}
    assert "1 eval task(s) of environment 'harbor' (no split); 4 excluded" in tasks.describe()
    assert "needs-gpu [backend]" in capsys.readouterr().out

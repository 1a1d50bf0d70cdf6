"""The `miles` command line, driven in-process through click's runner."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from miles_engine.cli.main import cli


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_help_lists_commands_without_importing_them():
    code, out, _ = invoke("--help")
    assert code == 0 and all(cmd in out for cmd in ("plugins", "recipes", "env", "sandbox", "eval"))


def test_plugins_json_shape_and_all_flag():
    code, out, _ = invoke("plugins", "--json")
    rows = json.loads(out)
    assert code == 0 and rows and not any(r["builtin"] for r in rows)
    assert {"distribution", "version", "kind", "name", "module"} <= set(rows[0])
    names = {(r["kind"], r["name"]) for r in rows}
    assert {("environment", "harbor"), ("environment", "terminal-bench"),
            ("environment", "terminal-tasks"), ("environment", "shell-drills")} <= names
    all_rows = json.loads(invoke("plugins", "--json", "--all")[1])
    assert ("sandbox", "local") in {(r["kind"], r["name"]) for r in all_rows}
    code, out, _ = invoke("plugins")
    assert code == 0 and "miles-env-harbor" in out


def test_recipes_ls_show_cp_validate(tmp_path):
    code, out, _ = invoke("recipes", "ls", "--json")
    names = {r["name"] for r in json.loads(out)}
    assert code == 0 and "terminal-tasks-oracle" in names
    code, out, _ = invoke("recipes", "show", "shell-drills-oracle")
    assert code == 0 and out.startswith("# miles eval shell-drills-oracle")
    code, out, _ = invoke("recipes", "show", "shell-drills-oracle", "eval.jobs=7")
    assert code == 0 and "jobs: 7" in out
    code, out, _ = invoke("recipes", "cp", "shell-drills-oracle", str(tmp_path))
    copied = tmp_path / "shell-drills-oracle.yaml"
    assert code == 0 and copied.read_text().startswith("# miles eval")
    assert invoke("recipes", "validate", str(copied), "eval.jobs=2")[0] == 0


def test_recipes_cp_refuses_to_overwrite(tmp_path):
    (tmp_path / "shell-drills-oracle.yaml").write_text("mine")
    with pytest.raises(Exception, match="already exists"):
        invoke("recipes", "cp", "shell-drills-oracle", str(tmp_path))


def test_env_ls_and_tasks():
    code, out, _ = invoke("env", "ls", "--json")
    assert code == 0 and "terminal-tasks" in {r["name"] for r in json.loads(out)}
    code, out, _ = invoke("env", "tasks", "terminal-tasks", "--json")
    tasks = json.loads(out)
    assert code == 0 and len(tasks) >= 30 and {"id", "difficulty", "tags"} <= set(tasks[0])
    code, out, _ = invoke("env", "tasks", "shell-drills", "-o", "num_tasks=6", "--json")
    assert code == 0 and len(json.loads(out)) == 6


def test_env_validate_json_passes_on_drills():
    code, out, _ = invoke("env", "validate", "shell-drills", "-o", "num_tasks=5", "--jobs", "3", "--json")
    report = json.loads(out)
    assert code == 0 and len(report["tasks"]) == 5
    assert all(t["passed"] and t["oracle_reward"] == 1.0 and t["nop_reward"] == 0.0 for t in report["tasks"])


def test_env_validate_fails_naming_the_broken_task(tmp_path):
    task = tmp_path / "broken-task"
    (task / "tests").mkdir(parents=True)
    (task / "solution").mkdir()
    (task / "instruction.md").write_text("Create /app/done.\n")
    (task / "task.toml").write_text('schema_version = "1.4"\n[environment]\nnetwork_mode = "no-network"\n')
    (task / "solution" / "solve.sh").write_text("touch /app/done\n")
    # a verifier that always passes: the no-op check must catch it
    (task / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    code, out, err = invoke("env", "validate", "harbor", "--path", str(tmp_path), "--json")
    report = json.loads(out)
    assert code == 1 and "broken-task" in err
    assert report["tasks"][0]["problems"] == ["no-op scored 1.0 (expected 0.0)"]


def test_unknown_environment_is_one_clear_error():
    from miles_engine.errors import UnknownComponentError

    with pytest.raises(UnknownComponentError, match="did you mean 'terminal-tasks'"):
        invoke("env", "tasks", "terminal-task")


def test_eval_runs_a_recipe_with_overrides():
    code, out, _ = invoke("eval", "shell-drills-oracle", "environment.options.num_tasks=4", "eval.jobs=4", "--json")
    report = json.loads(out)
    assert code == 0 and len(report["episodes"]) == 4 and report["mean_reward"] == 1.0

"""``miles new plugin``: the scaffold loads through the hub and its generated tests pass under pytest."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from miles_engine.cli.main import main
from miles_engine.hub import Hub, get_plugin_manager
from miles_engine.scaffold import KINDS, PluginNames, scaffold_plugin

HOOKS = {"environment": "miles_register_environments", "sandbox": "miles_register_sandboxes",
         "reward": "miles_register_rewards", "teacher": "miles_register_teachers", "agent": "miles_register_agents"}


def run_generated_tests(*plugin_dirs: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(d) for d in plugin_dirs),
           "MILES_DISABLE_PLUGIN_AUTOLOAD": "1"}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
            "-o", "addopts=", "--rootdir", str(plugin_dirs[0].parent), *(str(d / "tests") for d in plugin_dirs)]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=plugin_dirs[0].parent)


@pytest.mark.parametrize("kind", KINDS)
def test_scaffold_registers_through_the_hub(kind, tmp_path, monkeypatch):
    name = f"my-{kind}"
    target = scaffold_plugin(kind, name, tmp_path)
    names = PluginNames.of(kind, name)
    meta = tomllib.loads((target / "pyproject.toml").read_text())
    assert meta["project"]["name"] == names.distribution
    assert meta["project"]["entry-points"]["miles"] == {name: f"{names.package}.plugin"}
    monkeypatch.syspath_prepend(str(target))
    module = importlib.import_module(f"{names.package}.plugin")
    try:
        pm = get_plugin_manager(load_entrypoints=False)
        pm.register(module, name=names.package)
        comp = Hub(pm).component(kind, name)  # type: ignore[arg-type]
        assert comp.options.model_config.get("extra") == "forbid" and comp.description
        assert hasattr(module, HOOKS[kind])
    finally:
        for mod in [m for m in sys.modules if m.startswith(names.package)]:
            del sys.modules[mod]


def test_generated_tests_pass_under_pytest(tmp_path):
    dirs = [scaffold_plugin(kind, f"gen-{kind}", tmp_path) for kind in ("reward", "agent", "environment", "sandbox")]
    run = run_generated_tests(*dirs)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


@pytest.mark.slow
def test_generated_teacher_tests_pass_under_pytest(tmp_path):
    run = run_generated_tests(scaffold_plugin("teacher", "gen-teacher", tmp_path))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_generated_reward_tests_can_fail(tmp_path):
    """The generated suite is a real check: break the component and it fails."""
    target = scaffold_plugin("reward", "broken", tmp_path)
    plugin = target / "miles_reward_broken" / "plugin.py"
    plugin.write_text(plugin.read_text().replace("return RewardResult(reward=float(keyword in text)",
                                                 "return RewardResult(reward=float(keyword not in text)"))
    run = run_generated_tests(target)
    assert run.returncode != 0 and "expected reward 1.0, got 0.0" in run.stdout


def cli(*args: str) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    return exit_info.value.code


def test_cli_creates_and_refuses_to_overwrite(tmp_path, capsys):
    main(["new", "plugin", "--kind", "reward", "keyword", "--dest", str(tmp_path)])
    assert "created" in capsys.readouterr().out and (tmp_path / "keyword" / "miles_reward_keyword" / "plugin.py").is_file()
    before = (tmp_path / "keyword" / "pyproject.toml").read_text()
    assert cli("new", "plugin", "--kind", "agent", "keyword", "--dest", str(tmp_path)) == 2
    assert "already exists; refusing to overwrite" in capsys.readouterr().err
    assert (tmp_path / "keyword" / "pyproject.toml").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keyword"]  # no staging directory left behind


@pytest.mark.parametrize("bad", ["Bad", "my_plugin", "-x", "x-", "a--b", "1abc", "a" * 41, "class", ""])
def test_cli_validates_the_name(bad, tmp_path, capsys):
    assert cli("new", "plugin", "--kind", "reward", "--dest", str(tmp_path), "--", bad) == 2
    err = capsys.readouterr().err
    assert f"plugin name '{bad}' is not valid" in err or f"'{bad}' is a Python keyword" in err
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_unknown_kind_and_missing_dest(tmp_path, capsys):
    assert cli("new", "plugin", "--kind", "rewards", "x", "--dest", str(tmp_path)) == 2
    assert "'rewards' is not one of" in capsys.readouterr().err
    assert cli("new", "plugin", "--kind", "reward", "x", "--dest", str(tmp_path / "nope")) == 2
    assert "is not an existing directory" in capsys.readouterr().err

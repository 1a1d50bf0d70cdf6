"""Every command that reports a failure exits non-zero through the real entry point
(``miles_engine.cli.main:main``, what the ``miles`` console script calls), not only through
click's test runner: ``standalone_mode=False`` returns a raised ``click.exceptions.Exit``'s
code instead of raising it, so the entry point must pass it on."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from miles_engine.cli.main import main

BROKEN_TEST_SH = "#!/bin/bash\necho 'the verifier writes no reward'\n"
WRONG_SOLVE_SH = "#!/bin/bash\necho 41 > /app/answer.txt\n"
TEST_SH = (
    "#!/bin/bash\n"
    'if [ "$(cat /app/answer.txt 2>/dev/null)" = 42 ]; then echo 1 > /logs/verifier/reward.txt;'
    " else echo 0 > /logs/verifier/reward.txt; fi\n"
)
TOML = 'schema_version = "1.4"\n[verifier]\ntimeout_sec = 20.0\n[agent]\ntimeout_sec = 20.0\n'


def exit_code(*argv: str) -> int:
    """The status ``miles ARGV`` exits with (0 when main returns normally)."""
    try:
        main(list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def harbor_task(root: Path, *, test_sh: str = TEST_SH, solve_sh: str = "#!/bin/bash\necho 42 > /app/answer.txt\n") -> Path:
    task = root / "answer"
    (task / "tests").mkdir(parents=True)
    (task / "solution").mkdir()
    (task / "task.toml").write_text(TOML)
    (task / "instruction.md").write_text("Write 42 to /app/answer.txt.\n")
    (task / "tests" / "test.sh").write_text(test_sh)
    (task / "solution" / "solve.sh").write_text(solve_sh)
    return root


NO_ENGINE = ["--backend", "docker", "--option", "binary=/nonexistent/docker", "--case", "fork_bomb"]


def test_sandbox_check_not_contained_exits_1(capsys):
    assert exit_code("sandbox", "check", *NO_ENGINE) == 1
    assert "0/1 contained" in capsys.readouterr().out


def test_sandbox_check_exit_status_of_the_console_script():
    """The installed ``miles`` script, as a user's shell or CI sees it."""
    miles = shutil.which("miles") or str(Path(sys.executable).with_name("miles"))
    if not os.path.exists(miles):
        pytest.skip("no miles console script installed next to this interpreter")
    res = subprocess.run([miles, "sandbox", "check", *NO_ENGINE], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr


def test_env_validate_failing_oracle_exits_1(tmp_path):
    tasks = harbor_task(tmp_path, solve_sh=WRONG_SOLVE_SH)
    assert exit_code("env", "validate", "harbor", "--path", str(tasks), "--jobs", "1") == 1
    ok = harbor_task(tmp_path / "ok")
    assert exit_code("env", "validate", "harbor", "--path", str(ok), "--jobs", "1") == 0


def test_eval_with_no_scored_episode_exits_1(tmp_path):
    tasks = harbor_task(tmp_path, test_sh=BROKEN_TEST_SH)
    args = ["eval", "terminal-tasks-oracle", "environment.name=harbor", f"environment.options.path={tasks}"]
    assert exit_code(*args) == 1


def test_tito_check_failure_exits_non_zero(tmp_path):
    bad = tmp_path / "conversations.json"
    bad.write_text('[{"messages": "not a list"}]')
    assert exit_code("tito", "check", "--family", "qwen3", "--tokenizer", "builtin:qwen3",
                     "--conversations", str(bad), "--engine", "none") != 0


def test_recipes_validate_bad_recipe_exits_non_zero(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("environment:\n  name: terminal-tasks\nnot_a_section: 1\n")
    assert exit_code("recipes", "validate", str(bad)) != 0
    assert "not_a_section" in capsys.readouterr().err
    assert exit_code("recipes", "validate", "terminal-tasks-oracle") == 0

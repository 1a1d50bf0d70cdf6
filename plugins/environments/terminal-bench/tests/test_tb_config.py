"""task.yaml / solution.yaml: fields, defaults, the legacy spelling, and errors naming file, field, line."""

from __future__ import annotations

import textwrap

import pytest
from tb_testkit import TASK_YAML

from miles_engine.errors import TaskFormatError, TaskUnsupportedError
from miles_env_terminal_bench.config import load_solution_yaml, load_task_yaml


def write(tmp_path, text, name="task.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_full_task_yaml(tmp_path):
    cfg = load_task_yaml(write(tmp_path, TASK_YAML))
    assert cfg.prompt_text == "Write 42 to /app/answer.txt.\n"
    assert (cfg.difficulty, cfg.category, cfg.tags, cfg.parser_name) == ("easy", "file-operations", ["files", "demo"], "pytest")
    assert (cfg.max_agent_timeout_sec, cfg.max_test_timeout_sec, cfg.run_tests_in_same_shell) == (50, 20, False)


def test_defaults_are_terminal_benchs(tmp_path):
    cfg = load_task_yaml(write(tmp_path, "instruction: do it\nsome_future_key: 1\n"))
    assert (cfg.difficulty, cfg.parser_name, cfg.max_agent_timeout_sec, cfg.max_test_timeout_sec) == (
        "unknown", "pytest", 360.0, 60.0)


def test_legacy_descriptions_list(tmp_path):
    text = "descriptions:\n  - key: hard\n    description: other\n  - key: base\n    description: the base one\n"
    assert load_task_yaml(write(tmp_path, text)).prompt_text == "the base one"


@pytest.mark.parametrize(
    ("text", "needle"),
    [("instruction: x\nmax_test_timeout_sec: soon\n", r"task\.yaml:2: bad value for 'max_test_timeout_sec' \(got 'soon'\)"),
     ("instruction: x\ndifficulty: brutal\n", r"task\.yaml:2: bad value for 'difficulty'.*'easy', 'medium', 'hard' or 'unknown'"),
     ("instruction: x\ntags: 3\n", r"task\.yaml:2: bad value for 'tags'"),
     ("instruction: [1, 2]\n", r"task\.yaml:1: bad value for 'instruction'"),
     ("author_name: me\n", r"task\.yaml: .*needs 'instruction'"),
     ("instruction: x\nmax_agent_timeout_sec: -5\n", r"task\.yaml:2: bad value for 'max_agent_timeout_sec'"),
     ("instruction: x\nparser_name: junit\n", r"task\.yaml:2: parser_name 'junit' is not a parser this reader knows "
                                              r"\(terminal-bench's: pytest, swebench, sweperf, mlebench, swelancer\)"),
     ("instruction: x\n  bad: indent\n", r"task\.yaml:2: invalid YAML"),
     ("- just\n- a list\n", r"task\.yaml: task\.yaml must be a mapping of fields, got list"),
     ("", r"task\.yaml: task\.yaml must be a mapping of fields, got NoneType")],
)
def test_malformed_task_yaml_names_file_field_and_line(tmp_path, text, needle):
    with pytest.raises(TaskFormatError, match=needle):
        load_task_yaml(write(tmp_path, text))


@pytest.mark.parametrize("name", ["pytest", "swebench", "sweperf", "mlebench", "swelancer"])
def test_every_parser_terminal_bench_ships_is_read(tmp_path, name):
    assert load_task_yaml(write(tmp_path, f"instruction: x\nparser_name: {name}\n")).parser_name == name


def test_an_unknown_parser_is_unsupported_not_malformed(tmp_path):
    with pytest.raises(TaskUnsupportedError, match="parser_name 'formulacode'"):
        load_task_yaml(write(tmp_path, "instruction: x\nparser_name: formulacode\n"))


def test_solution_yaml(tmp_path):
    steps = load_solution_yaml(write(tmp_path, "- command: echo hi\n- command: vim\n  block: false\n  append_enter: false\n",
                                     "solution.yaml"))
    assert [(s.command, s.append_enter) for s in steps] == [("echo hi", True), ("vim", False)]
    with pytest.raises(TaskFormatError, match=r"solution\.yaml:2: missing required key '1\.command'"):
        load_solution_yaml(write(tmp_path, "- command: ok\n- block: true\n", "solution.yaml"))

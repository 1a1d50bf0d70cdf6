"""HarborSource: lazy listing, validation at load, unknown ids, and the plugin registration."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
from harbor_testkit import make_task

from miles_engine.environments.protocol import EnvironmentSource, Task, TaskRef
from miles_engine.errors import ConfigError, TaskFormatError, UnknownComponentError
from miles_env_harbor import HarborSource, HarborTask
from miles_env_harbor import plugin as harbor_plugin


def test_lists_task_dirs_lazily_with_metadata(tmp_path):
    make_task(tmp_path, "b-task")
    make_task(tmp_path, "a-task", toml='[task]\ndescription = "first"\nkeywords = ["k"]\n[metadata]\ndifficulty = "hard"\ntags = ["x"]\n')
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "README.md").write_text("hi")
    source = HarborSource(tmp_path)
    assert isinstance(source, EnvironmentSource) and source.name == "harbor"
    listing = source.list_tasks()
    assert next(listing) == TaskRef(id="a-task", difficulty="hard", tags=("x", "k"), description="first")
    assert [r.id for r in source.list_tasks()] == ["a-task", "b-task"]
    assert next(iter(source.list_tasks())).id == "a-task"


def test_single_task_directory(tmp_path):
    task_dir = make_task(tmp_path, "only")
    source = HarborSource(task_dir, name="one")
    assert [r.id for r in source.list_tasks()] == ["only"]
    task = source.load_task("only")
    assert isinstance(task, HarborTask) and isinstance(task, Task) and task.metadata["source"] == "one"
    with pytest.raises(UnknownComponentError, match="unknown task 'tests'"):
        source.load_task("tests")


def test_include_exclude_globs(tmp_path):
    for name in ("fix-a", "fix-b", "make-c"):
        make_task(tmp_path, name)
    source = HarborSource(tmp_path, include=["fix-*", "make-*"], exclude=["*-b"])
    assert source.task_ids() == ["fix-a", "make-c"]
    with pytest.raises(UnknownComponentError):
        source.load_task("fix-b")


def test_reusable_constructor_for_packaged_tasks(tmp_path):
    make_task(tmp_path, "t1")
    source = HarborSource(tmp_path, name="terminal-tasks")
    assert source.load_task("t1").metadata["source"] == "terminal-tasks"


@pytest.mark.parametrize(
    ("missing", "kwargs"),
    [("task.toml", {"toml": None}), ("instruction.md", {"instruction": None}), ("tests/test.sh", {"test_sh": None}),
     ("task.toml, instruction.md", {"toml": None, "instruction": None})],
)
def test_missing_parts_are_named(tmp_path, missing, kwargs):
    make_task(tmp_path, "broken", **kwargs)
    with pytest.raises(TaskFormatError, match=rf"Harbor task .*broken is missing {missing}$"):
        HarborSource(tmp_path).load_task("broken")


def test_malformed_toml_lists_but_fails_at_load_naming_file(tmp_path):
    make_task(tmp_path, "bad", toml="[agent\ntimeout_sec = 1\n")
    make_task(tmp_path, "good")
    source = HarborSource(tmp_path)
    assert [r.id for r in source.list_tasks()] == ["bad", "good"]
    with pytest.raises(TaskFormatError, match=r"bad/task\.toml: invalid TOML"):
        source.load_task("bad")


@pytest.mark.parametrize(
    ("toml", "instruction", "needle"),
    [('[[steps]]\nname = "one"\n', "x", r"t is missing steps/one/ \(the directory of step 'one'\)"),
     ('schema_version = "2.0"\n', "x", r"t/task\.toml:1: schema_version = '2\.0' is a task schema this reader does not know"),
     ('[environment]\nos = "windows"\n', "x", "os = 'windows' is not supported"),
     ("", "  \n", "instruction.md is empty")],
)
def test_unsupported_or_empty(tmp_path, toml, instruction, needle):
    make_task(tmp_path, "t", toml=toml, instruction=instruction)
    with pytest.raises(TaskFormatError, match=needle):
        HarborSource(tmp_path).load_task("t")


def test_unknown_id_did_you_mean_and_short_listing(tmp_path):
    for i in range(14):
        make_task(tmp_path, f"task-{i:02d}")
    with pytest.raises(UnknownComponentError) as err:
        HarborSource(tmp_path, name="mine").load_task("tsk-05")
    msg = str(err.value)
    assert "unknown task 'tsk-05' in environment 'mine' (did you mean 'task-05'?)" in msg
    assert "available (14): task-00," in msg and "… (4 more)" in msg and "task-13" not in msg
    with pytest.raises(UnknownComponentError, match="unknown task '../x'"):
        HarborSource(tmp_path).load_task("../x")


def test_missing_dataset_directory(tmp_path):
    with pytest.raises(TaskFormatError, match="environment 'harbor': task directory .*nope does not exist"):
        HarborSource(tmp_path / "nope")


def test_plugin_registers_harbor_with_typed_options(tmp_path):
    from miles_engine.hub import validate_options

    make_task(tmp_path, "t1")
    (comp,) = harbor_plugin.miles_register_environments()
    assert comp.name == "harbor"
    source = comp.factory(validate_options(comp, {"path": str(tmp_path), "exclude": ["zzz"]}, where="environment 'harbor'"))
    assert source.task_ids() == ["t1"]
    with pytest.raises(ConfigError, match="path"):
        validate_options(comp, {}, where="environment 'harbor'")
    with pytest.raises(ConfigError, match="pth"):
        validate_options(comp, {"pth": "x"}, where="environment 'harbor'")


def test_entry_point_is_installed():
    eps = {ep.name: ep.value for ep in entry_points(group="miles")}
    assert eps.get("harbor") == "miles_env_harbor.plugin"


def test_subclasses_choose_their_task_class(tmp_path):
    class MyTask(HarborTask):
        pass

    class MySource(HarborSource):
        task_class = MyTask

    make_task(tmp_path, "t1")
    task = MySource(tmp_path, name="mine").load_task("t1")
    assert type(task) is MyTask and task.metadata["source"] == "mine"

"""Held-out splits: disjoint, stable across runs and processes, on the drills and on task directories."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_engine.errors import ConfigError
from miles_engine.evaluation.config import EvalConfig
from miles_engine.evaluation.splits import check_disjoint, hash_fraction, select_eval_tasks, train_filter
from miles_engine.rollout.tasks import TaskStream
from miles_engine.hub import default_hub
from miles_env_harbor import HarborSource
from miles_env_terminal_tasks.drills import DrillOptions, ShellDrillsSource
from miles_env_terminal_tasks.packaged import packaged_source


def drills(n: int = 4000) -> ShellDrillsSource:
    return ShellDrillsSource(DrillOptions(kinds=["echo", "calc"], num_tasks=n))


def split_of_drills(salt: str = "miles-eval") -> tuple[list[str], list[str]]:
    cfg = EvalConfig(every=5, split={"salt": salt})
    source = drills()
    train = [r.id for r in TaskStream(source, task_filter=train_filter(cfg, source)).refs]
    held_out = select_eval_tasks(cfg, source, from_training_env=True).ids
    return train, held_out


def test_hash_split_of_the_drills_is_disjoint_complete_and_sized() -> None:
    train, held_out = split_of_drills()
    assert not set(train) & set(held_out)
    assert sorted(train + held_out) == sorted(r.id for r in drills().list_tasks())
    assert 0.085 < len(held_out) / 4000 < 0.115  # fraction 0.1 of 4000 ids
    check_disjoint(train, held_out, environment="shell-drills")  # no error
    other_train, other_eval = split_of_drills(salt="another")
    assert set(other_eval) != set(held_out)  # another salt, another split


def test_hash_split_is_stable_across_processes_and_pinned() -> None:
    _, held_out = split_of_drills()
    code = ("import json; from tests.evaluation.test_splits import split_of_drills; "
            "print(json.dumps(split_of_drills()[1]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      check=True, cwd=Path(__file__).resolve().parents[2]).stdout)
    assert other == held_out
    # pinned: a change of the hash or of its input format would move tasks between the sides
    assert held_out[:3] == PINNED_FIRST_EVAL_IDS
    assert hash_fraction("calc-000001", "miles-eval") == pytest.approx(PINNED_FRACTION, abs=1e-15)


PINNED_FIRST_EVAL_IDS = ["calc-000001", "calc-000003", "calc-000013"]
PINNED_FRACTION = 0.08689196766539092


def test_a_split_is_required_when_training_and_eval_tasks_overlap() -> None:
    source = drills(50)
    cfg = EvalConfig(every=5, split={"by": "none"})
    assert train_filter(cfg, source) is None
    train = [r.id for r in TaskStream(source).refs]
    eval_ids = select_eval_tasks(cfg, source, from_training_env=True).ids
    with pytest.raises(ConfigError, match=r"50 of the 50 eval task\(s\) are also training tasks .*eval.split.by"):
        check_disjoint(train, eval_ids, environment="shell-drills")


def test_source_split_of_a_task_directory(tmp_path: Path) -> None:
    for name, split in (("alpha", "train"), ("beta", "eval"), ("gamma", None), ("delta", "test")):
        d = tmp_path / name
        d.mkdir()
        meta = f'\n[metadata]\nsplit = "{split}"\n' if split else ""
        (d / "task.toml").write_text(f'schema_version = "1.4"\n{meta}')
        (d / "instruction.md").write_text("do it")
    source = HarborSource(tmp_path, name="dir")
    cfg = EvalConfig(every=1, split={"by": "source"})
    train = [r.id for r in TaskStream(source, task_filter=train_filter(cfg, source)).refs]
    held_out = select_eval_tasks(cfg, source, from_training_env=True).ids
    assert sorted(train) == ["alpha", "gamma"] and sorted(held_out) == ["beta", "delta"]


def test_hash_split_of_the_packaged_task_directories() -> None:
    source = packaged_source()
    cfg = EvalConfig(every=1, split={"fraction": 0.3})
    train = {r.id for r in TaskStream(source, task_filter=train_filter(cfg, source)).refs}
    held_out = select_eval_tasks(cfg, source, from_training_env=True).ids
    assert held_out and not train & set(held_out)
    assert train | set(held_out) == set(source.task_ids())


def test_source_split_needs_a_source_that_declares_one() -> None:
    with pytest.raises(ConfigError, match="declares no split of its own"):
        train_filter(EvalConfig(every=1, split={"by": "source"}), drills(10))


def test_no_split_outside_training_by_default() -> None:
    cfg = EvalConfig(limit=7)
    assert cfg.split_method == "none" and train_filter(cfg, drills(10)) is None
    assert select_eval_tasks(cfg, drills(10), from_training_env=True).ids == [r.id for r in drills(7).list_tasks()]


def test_resume_refuses_a_changed_split_and_names_the_keys(tmp_path: Path) -> None:
    """A resumed run whose train / eval split would differ from its checkpoint's is refused with
    one error naming the keys; keys that leave the split alone may change."""
    from miles_engine.config.recipe import load_recipe
    from miles_engine.checkpoint import compat as checkpoint_compat
    from miles_engine.evaluation.splits import resume_split_change

    def config(*overrides: str) -> dict:
        return load_recipe("tiny-terminal", list(overrides), hub=default_hub()).model_dump(mode="json")

    written = config("eval.every=5")
    manifest = {"fingerprint": checkpoint_compat.fingerprint(written, "tok"), "tokenizer_sha256": "tok",
                "layout": checkpoint_compat.layout(written), "config": written}

    def resume(*overrides: str) -> None:
        checkpoint_compat.check(manifest, config(*overrides), "tok", tmp_path, rules=[resume_split_change])

    resume("eval.every=5", "eval.limit=8", "eval.attempts=4", "eval.mode=dedicated")  # same split: fine
    resume("eval.every=10", "eval.split.by=hash")  # the same hash split, evaluated less often
    for overrides, named in [
            (["eval.every=5", "eval.split.fraction=0.2"], "eval.split.fraction: checkpoint 0.1, now 0.2"),
            (["eval.every=5", "eval.split.salt=other"], "eval.split.salt: checkpoint 'miles-eval', now 'other'"),
            ([], "eval.every: checkpoint 5, now None"),  # by: auto -> no split without eval.every
            (["eval.every=5", "eval.environment.name=shell-drills"], "eval.environment.name")]:
        with pytest.raises(ConfigError) as err:
            resume(*overrides)
        text = str(err.value)
        assert text.startswith(f"cannot resume from {tmp_path}: the train / eval split") and named in text, text
        assert "hash split, fraction 0.1, salt 'miles-eval'" in text  # what the checkpoint trained with
    # a run trained without a split may not start evaluating on its own training environment's tasks
    plain = config()
    manifest.update(fingerprint=checkpoint_compat.fingerprint(plain, "tok"), config=plain)
    with pytest.raises(ConfigError, match="the checkpoint trained with nothing held out \\(no split\\), this recipe "
                                          "with hash split"):
        resume("eval.every=5")
    resume("eval.every=5", "eval.environment.name=shell-drills")  # another environment: the training tasks stay


def test_eval_tasks_already_trained_by_the_run_are_refused(tmp_path: Path) -> None:
    """Defence in depth on resume: the groups in consumed.jsonl are checked against the eval set."""
    from miles_engine.evaluation.evaluator import trained_task_ids
    from miles_engine.checkpoint import consumed

    _, held_out = split_of_drills()
    consumed.append(tmp_path, 1, 1, [f"{held_out[3]}@7", "calc-x@8"])
    trained = trained_task_ids(tmp_path)
    assert trained == {held_out[3], "calc-x"}
    with pytest.raises(ConfigError, match=f"1 of the {len(held_out)} eval task\\(s\\) are also tasks this run already "
                                          f"trained on \\(consumed.jsonl\\) of environment 'shell-drills': "
                                          f"'{held_out[3]}'"):
        check_disjoint(trained, held_out, environment="shell-drills",
                       what="tasks this run already trained on (consumed.jsonl)")


def test_an_eval_environment_of_its_own_during_training(tmp_path: Path) -> None:
    """eval.environment: the eval tasks come from it, the training stream keeps all its tasks; the
    same environment under eval.environment shares task ids with training and is refused."""
    import asyncio
    from types import SimpleNamespace

    from miles_engine.config.recipe import load_recipe
    from miles_engine.evaluation.evaluator import _eval_tasks
    from miles_engine.hub import default_hub
    from miles_engine.sandbox.protocol import Capabilities

    hub = default_hub()
    # a backend that runs every task: this test is about the split, not about which tasks a backend can run
    runs_all = SimpleNamespace(capabilities=lambda: Capabilities(
        isolation="container", network_modes=frozenset({"none", "public"}), images=True, dockerfile_build=True,
        absolute_paths=True))

    def inputs(*overrides: str) -> SimpleNamespace:
        cfg = load_recipe("tiny-terminal", ["eval.every=2", "eval.limit=3", *overrides], hub=default_hub())
        source = hub.create("environment", cfg.environment.name, cfg.environment.options, where="environment.options")
        assert train_filter(cfg.eval, source) is None  # nothing held out of training
        return SimpleNamespace(cfg=cfg, hub=hub, source=source, tasks=TaskStream(source), run_dir=tmp_path,
                               backend=runs_all)

    closers: list = []
    tasks = _eval_tasks(inputs("eval.environment.name=terminal-tasks"), closers)
    assert tasks.source.name == "terminal-tasks" and tasks.split == "an eval environment of its own"
    assert len(tasks.ids) == 3 and set(tasks.ids) <= set(packaged_source().task_ids())
    for close in closers:
        asyncio.run(close())
    with pytest.raises(ConfigError, match="3 of the 3 eval task\\(s\\) are also training tasks of environment "
                                          "'shell-drills'"):
        _eval_tasks(inputs("eval.environment.name=shell-drills", "eval.environment.options.kinds=[echo, calc]",
                           "eval.environment.options.num_tasks=100000"), [])

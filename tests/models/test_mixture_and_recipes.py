"""The ``mixture`` environment (drills + packaged terminal tasks in one stream), model-source
resolution and ``miles recipes validate`` of the real-model recipes (no weights loaded)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from miles_engine.cli.main import cli
from miles_engine.errors import ConfigError, UnknownComponentError
from miles_engine.hub import Hub
from miles_engine.models.source import resolve
from miles_engine.rollout.tasks import TaskStream

pytest.importorskip("miles_env_terminal_tasks")

OPTIONS = {"sources": [{"name": "shell-drills", "options": {"kinds": ["echo", "calc"], "num_tasks": 50}},
                       {"name": "terminal-tasks", "options": {"include": ["hello-file", "make-tarball"]},
                        "repeat": 5}]}


def test_mixture_lists_loads_and_demonstrates():
    env = Hub().create("environment", "mixture", OPTIONS, where="environment.options")
    refs = list(env.list_tasks())
    assert len(refs) == 50 + 2 * 5 and len({r.id for r in refs}) == len(refs)
    assert env.load_task("1/hello-file#3").id == "hello-file"
    assert env.load_task("0/calc-000001").id == "calc-000001"
    with pytest.raises(UnknownComponentError, match="source index 0..1"):
        env.load_task("7/hello-file")
    caps = env.capabilities()
    assert caps.needs_sandbox and caps.absolute_paths and "bash" in caps.tools
    demos = list(env.demonstrations(6, seed=1))  # only the drills have demonstrations
    assert len(demos) == 6 and all(d.task.id.split("-")[0] in ("echo", "calc") for d in demos)
    stream = iter(TaskStream(env, seed=0))
    assert {next(stream).id.split("/")[0] for _ in range(60)} == {"0", "1"}


def test_model_sources(tmp_path):
    assert resolve("tiny:qwen3").kind == "tiny"
    with pytest.raises(ConfigError, match="never downloaded"):
        resolve(tmp_path / "nope")
    with pytest.raises(ConfigError, match="pass model.path=DIR"):
        resolve("required")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert resolve(tmp_path).kind == "config"
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert resolve(tmp_path).kind == "hf"  # sharded safetensors: from_pretrained reads the index


def test_recipes_validate_resolves_the_model(tmp_path):
    runner = CliRunner()
    result = runner.invoke(cli, ["recipes", "validate", "qwen3-terminal"])
    assert result.exit_code != 0 and "pass model.path=DIR" in str(result.exception)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 151936}))
    result = runner.invoke(cli, ["recipes", "validate", "qwen3-terminal", f"model.path={tmp_path}"])
    assert result.exit_code == 0, result.output
    assert "random init" in result.output and "builtin:qwen3" in result.output and "chat family qwen3" in result.output
    result = runner.invoke(cli, ["recipes", "validate", "smollm2-terminal"])
    if "no installed Python package" not in str(result.exception):
        assert result.exit_code == 0, result.output
        assert "gguf" in result.output and "embedded vocabulary" in result.output

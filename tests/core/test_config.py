"""Typed recipes: line-numbered errors, did-you-mean, overrides, component options."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_engine.config import load_recipe
from miles_engine.errors import ConfigError
from miles_engine.hub import default_hub

GOOD = """\
# miles eval my.yaml
environment:
  name: shell-drills
  options:
    num_tasks: 5
sandbox:
  backend: local
agent:
  name: oracle
eval:
  jobs: 2
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "my.yaml"
    path.write_text(text)
    return path


def error_of(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        load_recipe(path, overrides, hub=default_hub())
    return str(err.value)


def test_good_recipe_and_overrides(tmp_path):
    cfg = load_recipe(write(tmp_path, GOOD), ["eval.jobs=8", "environment.options.num_tasks=7", "seed=3"],
                      hub=default_hub())
    assert (cfg.eval.jobs, cfg.environment.options["num_tasks"], cfg.seed) == (8, 7, 3)


def test_unknown_top_level_key_names_file_line_and_suggestion(tmp_path):
    path = write(tmp_path, GOOD + "evall:\n  jobs: 3\n")
    msg = error_of(path)
    assert f"{path}:12:" in msg and "unknown key 'evall'" in msg and "did you mean 'eval'" in msg


def test_unknown_nested_key(tmp_path):
    msg = error_of(write(tmp_path, GOOD.replace("  jobs: 2", "  jbos: 2")))
    assert ":11:" in msg and "unknown key 'eval.jbos'" in msg and "did you mean 'jobs'" in msg


def test_bad_value_names_key_and_constraint(tmp_path):
    msg = error_of(write(tmp_path, GOOD.replace("jobs: 2", "jobs: 0")))
    assert ":11:" in msg and "'eval.jobs'" in msg and "got 0" in msg and "greater than or equal to 1" in msg


def test_literal_value_lists_allowed_values(tmp_path):
    text = GOOD.replace("  backend: local", "  backend: local\n  options:\n    isolation: strongest")
    msg = error_of(write(tmp_path, text))
    assert "sandbox.options.isolation" in msg and "'auto'" in msg and "'namespace'" in msg


def test_component_option_typo_has_line(tmp_path):
    msg = error_of(write(tmp_path, GOOD.replace("num_tasks: 5", "num_taks: 5")))
    assert ":5:" in msg and "environment.options.num_taks" in msg and "did you mean 'num_tasks'" in msg


def test_unknown_component_name_has_line(tmp_path):
    msg = error_of(write(tmp_path, GOOD.replace("name: oracle", "name: oracel")))
    assert ":9:" in msg and "did you mean 'oracle'" in msg


def test_bad_override_value_and_form(tmp_path):
    path = write(tmp_path, GOOD)
    assert "eval.jobs" in error_of(path, ["eval.jobs=many"])
    assert "key=value" in error_of(path, ["eval.jobs"])
    assert "is a value, not a section" in error_of(path, ["eval.jobs.x=1"])


def test_yaml_syntax_error_has_line(tmp_path):
    msg = error_of(write(tmp_path, "environment:\n  name: [unclosed\n"))
    assert "invalid YAML" in msg and "my.yaml:" in msg


def test_duplicate_key(tmp_path):
    msg = error_of(write(tmp_path, GOOD + "seed: 1\nseed: 2\n"))
    assert "duplicate key 'seed'" in msg and ":13" in msg


def test_missing_recipe_and_unknown_packaged_name(tmp_path):
    assert "does not exist" in error_of(tmp_path / "nope.yaml")
    with pytest.raises(Exception, match="unknown recipe 'no-such-recipe'"):
        load_recipe("no-such-recipe", hub=default_hub())


def test_every_packaged_recipe_validates_and_starts_with_its_command():
    from miles_engine.hub import Hub

    recipes = Hub().registry("recipe")
    assert recipes
    for name, reg in recipes.items():
        first = reg.component.path.read_text().splitlines()[0]
        assert first.startswith("# miles ") and name in first, (name, first)
        load_recipe(name, hub=default_hub())


def test_lora_with_the_megatron_backend_is_refused_at_load(tmp_path):
    """The Megatron trainer has no adapters: it would train the full model and `miles export --merged`
    would merge none onto the untrained base. One error at load names both keys and the fix."""
    path = write(tmp_path, GOOD)
    msg = error_of(path, ["trainer.backend=megatron", "trainer.lora.enabled=true"])
    assert f"{path}:" in msg and "'trainer'" in msg and "lora.enabled=true needs backend='torch'" in msg, msg
    assert load_recipe(path, ["trainer.lora.enabled=true"], hub=default_hub()).trainer.lora.enabled


def test_routing_replay_turns_on_recording_the_routed_experts(tmp_path):
    """R3 replays the experts the engine recorded: routing_replay implies the session server records
    them; an explicit record_routed_experts=false with it is one error instead of a silent no-op."""
    path = write(tmp_path, GOOD)
    assert not load_recipe(path, hub=default_hub()).session_server.record_routed_experts
    cfg = load_recipe(path, ["trainer.algorithm.routing_replay=true"], hub=default_hub())
    assert cfg.session_server.record_routed_experts
    msg = error_of(path, ["trainer.algorithm.routing_replay=true", "session_server.record_routed_experts=false"])
    assert "session_server.record_routed_experts=false records none" in msg and "drop that override" in msg, msg

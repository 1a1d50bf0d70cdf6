"""``rollout.on_update``: one key for what a push does to running requests, checked against the engines."""

from __future__ import annotations

import pytest

from miles_engine.config.recipe import load_recipe
from miles_engine.errors import ConfigError
from miles_engine.hub import default_hub


def _load(*overrides: str):
    return load_recipe("tiny-terminal", list(overrides), hub=default_hub())


def test_the_default_is_retract_and_each_mode_loads_on_our_engines():
    assert _load().rollout.on_update == "retract"
    for mode in ("retract", "in_place", "abort", "wait"):
        assert _load(f"rollout.on_update={mode}").rollout.on_update == mode


def test_an_unknown_mode_names_the_key_and_the_allowed_values():
    with pytest.raises(ConfigError, match=r"rollout\.on_update.*'retract'.*'in_place'.*'abort'.*'wait'"):
        _load("rollout.on_update=later")


def test_modes_a_third_party_engine_cannot_honour_are_refused_with_why():
    with pytest.raises(ConfigError, match=r"rollout\.on_update='wait' cannot be honoured by engines\.0\.kind='sglang'"
                                          r".*no mode that lets them finish"):
        _load("engines=[{kind: sglang}]", "weights.transport=broadcast", "rollout.on_update=wait")
    with pytest.raises(ConfigError, match=r"rollout\.on_update='in_place' cannot be honoured by engines\.0\.kind='vllm'"
                                          r".*versions would be guessed"):
        _load("engines=[{kind: vllm}]", "weights.transport=broadcast", "rollout.on_update=in_place")
    with pytest.raises(ConfigError, match=r"engines\.0\.kind='external'"):
        _load("engines=[{kind: external, options: {urls: ['http://127.0.0.1:1'], api: vllm}}]",
              "weights.transport=broadcast", "rollout.on_update=in_place")
    assert _load("engines=[{kind: vllm}]", "weights.transport=broadcast", "rollout.on_update=wait")


def test_disk_delta_pause_mode_is_the_older_spelling_and_may_not_disagree():
    with pytest.raises(ConfigError, match=r"weights\.disk_delta\.pause_mode='abort' differs from rollout\.on_update"):
        _load("engines=[{kind: server}]", "weights.transport=disk_delta", "weights.disk_delta.pause_mode=abort",
              "rollout.on_update=wait")
    cfg = _load("engines=[{kind: server}]", "weights.transport=disk_delta", "weights.disk_delta.pause_mode=abort")
    assert cfg.rollout.on_update == "abort"
    # a run's config.yaml carries the one key: a resume with another rollout.on_update is not a conflict
    dumped = cfg.model_dump(mode="json")
    assert "pause_mode" not in dumped["weights"]["disk_delta"] and dumped["rollout"]["on_update"] == "abort"

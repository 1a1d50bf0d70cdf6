"""TrainerConfig: defaults, cross-field errors naming their keys, unknown keys."""

from __future__ import annotations

import pytest

from miles_engine.errors import ConfigError
from miles_engine.trainer import TrainerConfig


def test_defaults_are_grpo_token_mean() -> None:
    cfg = TrainerConfig()
    assert cfg.algorithm.advantage_estimator == "grpo" and cfg.loss_aggregation == "token_mean"
    assert cfg.clip.high == cfg.clip.eps_low == 0.2 and cfg.grad_clip == 1.0 and cfg.num_threads == 1
    assert TrainerConfig.load({"clip": {"eps_low": 0.2, "eps_high": 0.28}}).clip.high == 0.28


def test_inverted_mismatch_bounds_name_both_keys() -> None:
    with pytest.raises(ConfigError) as err:
        TrainerConfig.load({"mismatch": {"mode": "tis", "low": 3.0, "high": 2.0}})
    msg = str(err.value)
    assert "mismatch.low" in msg and "mismatch.high" in msg and "trainer.mismatch" in msg


def test_group_size_one_with_std_normalisation_names_both_keys() -> None:
    cfg = TrainerConfig()
    with pytest.raises(ConfigError) as err:
        cfg.check_group_size(1, key="rollout.group_size")
    assert "rollout.group_size" in str(err.value) and "grpo_std_normalization" in str(err.value)
    cfg.check_group_size(2, key="rollout.group_size")
    TrainerConfig.load({"algorithm": {"grpo_std_normalization": False}}).check_group_size(1)
    TrainerConfig.load({"algorithm": {"advantage_estimator": "ppo"}}).check_group_size(1)


def test_unknown_key_is_an_error_with_a_suggestion() -> None:
    with pytest.raises(ConfigError) as err:
        TrainerConfig.load({"optimizer": {"lrr": 1e-3}})
    assert "unknown key 'trainer.optimizer.lrr'" in str(err.value) and "did you mean 'lr'" in str(err.value)
    with pytest.raises(ConfigError, match="allowed"):
        TrainerConfig.load({"loss_aggregation": "mean"})


@pytest.mark.parametrize(("data", "words"), [
    ({"kl": {"coef": 0.1}}, ["kl.coef", "kl.reference"]),
    ({"kl": {"placement": "reward", "reference": True}}, ["kl.placement", "advantage_estimator"]),
    ({"mismatch": {"mode": "tis"}, "algorithm": {"old_logprobs": "rollout"}}, ["mismatch.mode", "old_logprobs"]),
    ({"lr_schedule": {"kind": "cosine"}}, ["lr_schedule.total_steps"]),
    ({"lr_schedule": {"kind": "linear", "warmup_steps": 5, "total_steps": 2}}, ["warmup_steps", "total_steps"]),
    ({"clip": {"dual_clip_c": 0.5}}, ["clip.dual_clip_c"]),
])
def test_incompatible_settings(data: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        TrainerConfig.load(data)
    for w in words:
        assert w in str(err.value)


def test_config_module_imports_without_torch() -> None:
    import subprocess
    import sys

    code = ("import sys; import miles_engine.trainer as t; t.TrainerConfig(); import miles_engine.trainer.rows; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)

"""Incompatible training settings are refused before anything runs, naming the keys."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles_engine.config import load_recipe
from miles_engine.errors import ConfigError, SandboxUnsupportedError
from miles_engine.train.compose import compose


def build_error(tmp_path: Path, overrides: list[str]) -> str:
    cfg = load_recipe("tiny-terminal", overrides)

    async def go() -> None:
        async with compose(cfg, tmp_path / "run"):
            pass

    with pytest.raises((ConfigError, SandboxUnsupportedError)) as err:
        asyncio.run(go())
    assert not (tmp_path / "run" / "checkpoints").exists()
    return str(err.value)


def load_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        load_recipe("tiny-terminal", overrides)
    return str(err.value)


def test_fully_async_with_colocated_trainer_is_refused(tmp_path):
    msg = build_error(tmp_path, ["rollout.mode=fully_async", "placement.trainer=in_process"])
    assert "fully_async" in msg and "colocated" in msg


def test_group_size_one_with_std_normalisation_names_both_keys(tmp_path):
    msg = build_error(tmp_path, ["rollout.group_size=1"])
    assert "rollout.group_size=1" in msg and "grpo_std_normalization" in msg


def test_inverted_tis_bounds():
    msg = load_error(["trainer.mismatch.low=3.0", "trainer.mismatch.high=0.5"])
    assert "trainer.mismatch" in msg


def test_negative_max_staleness():
    msg = load_error(["buffer.max_staleness=-1"])
    assert "buffer.max_staleness" in msg and "greater than or equal to 0" in msg


def test_empty_task_set(tmp_path):
    empty = tmp_path / "no-tasks"
    empty.mkdir()
    msg = build_error(tmp_path, ["environment.name=harbor", f"environment.options={{path: {empty}}}",
                                 "sft.enabled=false", "tokenizer.path=builtin:bpe-chatml"])
    assert "no tasks" in msg or "nothing to train on" in msg


def test_sandbox_backend_that_cannot_run_the_tasks(tmp_path):
    msg = build_error(tmp_path, ["sandbox.options={isolation: process}"])
    assert "cannot run" in msg and "network 'none'" in msg and "'local'" in msg

"""Incompatible training settings are refused before anything runs, naming the keys."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles_engine.config import load_recipe
from miles_engine.errors import ConfigError, SandboxUnsupportedError
from miles_engine.run.compose import compose
from miles_engine.hub import default_hub


def build_error(tmp_path: Path, overrides: list[str]) -> str:
    cfg = load_recipe("tiny-terminal", overrides, hub=default_hub())

    async def go() -> None:
        async with compose(cfg, tmp_path / "run", hub=default_hub()):
            pass

    with pytest.raises((ConfigError, SandboxUnsupportedError)) as err:
        asyncio.run(go())
    assert not (tmp_path / "run" / "checkpoints").exists()
    return str(err.value)


def load_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        load_recipe("tiny-terminal", overrides, hub=default_hub())
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


def test_impossible_engine_transport_pair_is_one_line_naming_both_keys():
    msg = load_error(["engines.0.kind=server"])  # weights.transport defaults to colocated
    assert "\n" not in msg and "weights.transport='colocated'" in msg and "engines.0.kind='server'" in msg
    assert "['broadcast', 'disk_delta', 'p2p']" in msg
    msg = load_error(["engines=[{kind: embedded}, {kind: server}]", "weights.transport=broadcast"])
    assert "engines.0.kind='embedded'" in msg and "['colocated', 'disk_delta']" in msg


def test_engine_kind_and_options_are_checked_at_load():
    assert "unknown engine 'serverr'" in load_error(["engines.0.kind=serverr"])
    msg = load_error(["engines.0.options.max_batch_siz=8"])
    assert "engines.0.options.max_batch_siz" in msg and "max_batch_size" in msg
    assert "cuda:N" in load_error(["engines.0.device=gpu"])
    assert "engines, a list of engine groups" in load_error(["engine.threads=2"])
    assert "trainer.parallel.world_size" in load_error(["placement.trainer_ranks=2"])


def test_external_engine_down_at_start_names_the_url(tmp_path):
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    msg = build_error(tmp_path, [f"engines=[{{kind: external, options: {{urls: ['{url}']}}}}]",
                                 "weights.transport=broadcast", "sft.enabled=false", "tokenizer.corpus_demos=200"])
    assert url in msg and "not reachable at start" in msg

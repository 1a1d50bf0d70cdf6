"""An SFT-only run (run.steps 0, sft.dataset of drill transcripts with tool calls): the loss
falls, the held-out eval loss is logged, and a run stopped mid-SFT resumes to the very weights
of an uninterrupted run."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
import yaml

from miles_engine.config.recipe import load_recipe
from miles_engine import checkpoint
from miles_engine.run.driver import run_recipe
from miles_engine.hub import default_hub

pytestmark = pytest.mark.slow


def recipe(tmp_path, transcripts: str) -> str:
    data = {
        "environment": {"name": "shell-drills", "options": {"kinds": ["echo", "calc"]}},
        "agent": {"name": "tito", "options": {"max_turns": 2, "max_tokens": 16}},
        "tokenizer": {"vocab_size": 400, "corpus_demos": 200, "cache": False},
        "model": {"arch": "qwen3", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 512},
        "placement": {"trainer": "in_process"},
        "rollout": {"mode": "sync", "group_size": 2, "groups_per_step": 1},
        "sft": {"batch_size": 8, "epochs": 2, "dataset": {
            "path": transcripts, "export_demos": {"n": 96, "seed": 2}, "fields": {"id": "task_id"},
            "eval_fraction": 0.2, "pack_tokens": 1200, "eval_every": 4, "cache_dir": str(tmp_path / "cache")}},
        "trainer": {"optimizer": {"lr": 0.01}, "num_threads": 1},
        "metrics": {"progress": False},
        "run": {"steps": 0},
    }
    path = tmp_path / "sft-only.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def run(path: str, run_dir, *, resume: bool = False, stop_after: int | None = None) -> None:
    def started(training) -> None:
        if stop_after is not None:  # as Ctrl-C after that many SFT steps
            backend = training.parts.trainer.backend
            step = backend.sft_step
            calls = [0]

            def stepping(batch):
                calls[0] += 1
                training.stop_requested = calls[0] >= stop_after
                return step(batch)

            backend.sft_step = stepping

    asyncio.run(run_recipe(load_recipe(path, hub=default_hub()), run_dir, resume=resume, on_start=started,
                           hub=default_hub()))


def sft_rows(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "sft"]


def final_weights(run_dir) -> dict:
    return checkpoint.load_latest(run_dir).trainer_state["model"]


def test_sft_only_loss_falls_and_resume_is_exact(tmp_path):
    torch.set_num_threads(1)
    transcripts = str(tmp_path / "drills.jsonl")
    path = recipe(tmp_path, transcripts)
    whole = tmp_path / "whole"
    run(path, whole)
    rows = sft_rows(whole)
    steps = len(rows)
    assert steps >= 8 and rows[-1]["sft/epoch"] == pytest.approx(2.0)
    first, last = rows[0]["sft/loss"], rows[-1]["sft/loss"]
    assert last < 0.7 * first, (first, last)
    evals = [r["sft/eval_loss"] for r in rows if "sft/eval_loss" in r]
    assert len(evals) >= 2 and evals[-1] < evals[0]
    assert rows[0]["sft/eval_rows"] > 0 and rows[0]["sft/bad_rows"] == 0
    assert [p.name for p in checkpoint.list_checkpoints(whole)] == ["step_00000000"]  # no RL step ran

    cut = tmp_path / "cut"
    run(path, cut, stop_after=3)
    assert checkpoint.latest(cut) is None and checkpoint.latest(cut / "sft").name == "step_00000003"
    run(path, cut, resume=True)
    assert [r["step"] for r in sft_rows(cut)] == list(range(1, 4)) + list(range(4, steps + 1))
    a, b = final_weights(whole), final_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

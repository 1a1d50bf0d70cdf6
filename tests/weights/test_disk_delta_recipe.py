"""The tiny-terminal recipe, shortened, runs end to end over the disk_delta transport with
both encodings: versions advance on disk and the engine ends with exactly the trainer's weights."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles_engine.config.recipe import load_recipe
from miles_engine.weights.disk_delta.layout import read_index, scan
from miles_engine.weights.tensors import digests
from miles_engine.hub import default_hub

SHORT = ["sft.enabled=false", "tokenizer.corpus_demos=300", "rollout.mode=sync", "placement.trainer=in_process",
         "rollout.group_size=2", "rollout.groups_per_step=2", "rollout.max_inflight=4", "buffer.capacity_groups=4",
         "run.steps=3", "metrics.progress=false", "weights.transport=disk_delta", "weights.disk_delta.retain=1"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_tiny_recipe_runs_over_disk_delta(tmp_path: Path, encoding: str) -> None:
    from miles_engine.run.driver import run_recipe

    cfg = load_recipe("tiny-terminal", [*SHORT, f"weights.disk_delta.encoding={encoding}",
                                        f"run.out_dir={tmp_path}"], hub=default_hub())
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    runs = []
    last = asyncio.run(run_recipe(cfg, run_dir, on_start=runs.append, hub=default_hub()))
    parts = runs[0].parts
    engine = digests(parts.engines.slots[0].engine.model.state_dict())
    trainer = digests(dict(parts.trainer.backend.named_tensors()))
    assert last == 3
    assert trainer and all(engine[n] == d for n, d in trainer.items())  # every pushed tensor, bit for bit
    complete, torn = scan(run_dir / "weights")
    assert torn == [] and complete[0] == 0 and complete[-1] >= 3 and len(complete) == 2  # retain=1 + baseline
    index = read_index(run_dir / "weights", complete[-1])
    assert index.encoding == encoding and index.base_version is not None
    rows = (run_dir / "metrics.jsonl").read_text()
    assert '"weights/changed_density"' in rows and '"weights/pause_s"' in rows

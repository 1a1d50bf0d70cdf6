"""weights.check_update_equal wired end to end: the tiny-terminal recipe, shortened, runs with the
check on over colocated and disk_delta (every push verified, weights/check_s and weights/tensors_checked logged), and the same
run over a transport that skips one tensor stops at the first push naming that tensor."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from miles_engine.config.recipe import load_recipe
from miles_engine.weights import TRANSPORTS
from miles_engine.weights.check import WeightCheckError
from miles_engine.weights.colocated import ColocatedTransport
from miles_engine.hub import default_hub

SHORT = ["sft.enabled=false", "tokenizer.corpus_demos=300", "rollout.mode=sync", "placement.trainer=in_process",
         "rollout.group_size=2", "rollout.groups_per_step=2", "rollout.max_inflight=4", "buffer.capacity_groups=4",
         "run.steps=2", "metrics.progress=false", "weights.check_update_equal=true"]
SKIPPED = "model.norm.weight"


class ColocatedSkippingOne(ColocatedTransport):
    """The colocated transport with a bug: it never sends one tensor."""

    async def push(self, named_tensors, version):
        return await super().push([(n, t) for n, t in named_tensors if n != SKIPPED], version)


async def _train(cfg, run_dir: Path, switch_intervals: list[float] | None = None) -> int:
    from miles_engine.run.driver import run_recipe

    def started(_run: object) -> None:
        if switch_intervals is not None:
            switch_intervals.append(sys.getswitchinterval())

    return await run_recipe(cfg, run_dir, on_start=started, hub=default_hub())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["colocated", "disk_delta"])
def test_recipe_runs_with_every_push_checked(tmp_path: Path, transport: str) -> None:
    cfg = load_recipe("tiny-terminal", [*SHORT, f"weights.transport={transport}", f"run.out_dir={tmp_path}"],
                      hub=default_hub())
    assert cfg.weights.check is not None and cfg.weights.check.tolerance is None
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    before, during = sys.getswitchinterval(), []
    assert asyncio.run(_train(cfg, run_dir, during)) == 2
    # the engine thread and the event loop share the driver's GIL: a short switch interval
    # while the run lasts (engines.N.options.gil_switch_interval_ms), the process's own one after it
    assert during == [0.5 / 1000] and sys.getswitchinterval() == before
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 2
    assert all(r["weights/tensors_checked"] > 0 and r["weights/check_s"] > 0 for r in train)


@pytest.mark.timeout(180)
def test_recipe_stops_on_a_transport_that_skips_a_tensor(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(TRANSPORTS, "colocated", f"{__name__}:ColocatedSkippingOne")
    cfg = load_recipe("tiny-terminal", [*SHORT, f"run.out_dir={tmp_path}"], hub=default_hub())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(WeightCheckError) as err:
        asyncio.run(_train(cfg, run_dir))
    msg = str(err.value)
    assert f"{SKIPPED!r} was never written" in msg and msg.count("was never written") == 1
    assert "colocated push of weight version 0" in msg

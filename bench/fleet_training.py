"""Training throughput of tiny-terminal per fleet (part of ``bench/fleet_bench.py``).

One SFT warm start (the recipe as shipped, then 1 RL step on its embedded engine), then for each
fleet a copy of that run directory resumed for ``steps`` RL steps (the fleet and the transport may
change on resume), fleets interleaved over ``repeats`` rounds. Steady samples/s: the samples of
the steps after the first two over their wall time (``time/elapsed`` deltas).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
FLEETS = {
    "1 embedded": ["engines=[{kind: embedded}]", "weights.transport=colocated"],
    "1 server": ["engines=[{kind: server, replicas: 1}]", "weights.transport=broadcast"],
    "2 server": ["engines=[{kind: server, replicas: 2}]", "weights.transport=broadcast"],
}


def _train(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "miles_engine.cli.main", "train", *args], env=ENV, cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"miles train {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def samples_per_s(run: Path, skip: int = 2) -> float:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"][1 + skip:]  # the warm run's step, then warm-up steps
    if len(train) < 2:
        return float("nan")
    wall = train[-1]["time/elapsed"] - train[0]["time/elapsed"]
    return sum(r["rollout/num_samples"] for r in train[1:]) / wall


def measure(steps: int = 20, repeats: int = 2, fleets: dict[str, list[str]] | None = None,
            sft_epochs: float | None = None) -> dict[str, list[float]]:
    """``sft_epochs``: a shorter warm start than the recipe's (a loaded box); the fleets still share it."""
    fleets = fleets or FLEETS
    out: dict[str, list[float]] = {name: [] for name in fleets}
    with tempfile.TemporaryDirectory(prefix="miles-fleet-bench-") as tmp:
        base = Path(tmp)
        shorter = [] if sft_epochs is None else [f"sft.epochs={sft_epochs}"]
        _train(["tiny-terminal", "run.steps=1", "run.max_minutes=null", "metrics.progress=false",
                f"run.out_dir={base}", "run.name=warm", *shorter])
        for rep in range(repeats):
            for i, (name, overrides) in enumerate(fleets.items()):
                run = base / f"r{rep}-{i}"
                shutil.copytree(base / "warm", run)
                _train(["--resume", str(run), *overrides, f"run.steps={steps + 1}", "run.max_minutes=null",
                        "metrics.progress=false"])
                out[name].append(samples_per_s(run))
                print(f"  round {rep + 1}, {name}: {out[name][-1]:.1f} samples/s", flush=True)
                shutil.rmtree(run)
    return out


def report(results: dict[str, list[float]], steps: int) -> None:
    base = statistics.median(next(iter(results.values())))
    print(f"\nTraining throughput: tiny-terminal, {steps} RL steps per run, fleets interleaved")
    print(f"{'fleet':>12}{'samples/s median':>18}{'range':>18}{'vs first':>10}")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"{name:>12}{med:>18.1f}{f'{min(values):.1f}-{max(values):.1f}':>18}{med / base:>9.2f}x")

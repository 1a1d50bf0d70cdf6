"""The cost of Ray at one node (prints a table; not a test).

    .venv/bin/python bench/ray_bench.py [--steps 12] [--repeats 2] [--warm RUN_DIR]

tiny-terminal with 2 ``server`` engines and broadcast weights, resumed from one SFT warm start,
with ``placement.backend=local`` (engines and the trainer rank as subprocesses) vs ``ray`` (the
same processes as Ray actors on a private loopback cluster of this machine's CPUs; trainer rank 0
broadcasts the weights) and ``ray+ss`` (also one TITO session-server actor), interleaved over
``--repeats`` rounds. Columns: start-up and teardown overhead (the process's
wall time minus the RL steps' own time: joining / starting the cluster, placement groups,
actors, engines, the first push) and steady samples/s (the steps after the first two).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fleet_training import ENV, ROOT, _train, samples_per_s  # noqa: E402

FLEET = ["engines=[{kind: server, replicas: 2}]", "weights.transport=broadcast", "run.max_minutes=null",
         "metrics.progress=false"]
PLACEMENTS = {
    "local": ["placement.backend=local"],
    "ray": ["placement.backend=ray", "placement.ray.engine_resources={CPU: 0.5}", "placement.ray.trainer_resources={CPU: 0.5}",
            "placement.ray.runner_resources={CPU: 0.25}"],
    # the episodes' turns through a session-server actor instead of the driver's server
    "ray+ss": ["placement.backend=ray", "placement.ray.engine_resources={CPU: 0.5}",
               "placement.ray.trainer_resources={CPU: 0.5}", "placement.ray.runner_resources={CPU: 0.2}",
               "placement.ray.session_servers=1", "placement.ray.session_server_resources={CPU: 0.1}"],
}


def one_run(warm: Path, run: Path, overrides: list[str], steps: int) -> tuple[float, float]:
    shutil.copytree(warm, run)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "miles_engine.cli.main", "train", "--resume", str(run), *FLEET,
                           *overrides, f"run.steps={steps + 1}"], env=ENV, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"][1:]  # after the warm run's step
    overhead = wall - train[-1]["time/elapsed"]
    return overhead, samples_per_s(run)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warm", type=Path, help="a warm run made earlier (tiny-terminal run.steps=1): skips the SFT")
    args = ap.parse_args()
    results: dict[str, dict[str, list[float]]] = {p: {"overhead": [], "sps": []} for p in PLACEMENTS}
    with tempfile.TemporaryDirectory(prefix="miles-ray-bench-") as tmp:
        base = Path(tmp)
        warm = args.warm or base / "warm"
        if args.warm is None:
            _train(["tiny-terminal", "run.steps=1", "run.max_minutes=null", "metrics.progress=false",
                    f"run.out_dir={base}", "run.name=warm"])
        for rep in range(args.repeats):
            for name, overrides in PLACEMENTS.items():
                overhead, sps = one_run(warm, base / f"{name}-{rep}", overrides, args.steps)
                results[name]["overhead"].append(overhead)
                results[name]["sps"].append(sps)
                shutil.rmtree(base / f"{name}-{rep}")
    print(f"\ntiny-terminal, 2 server engines + broadcast, {args.steps} RL steps per run, {args.repeats} "
          f"interleaved rounds")
    print(f"{'placement':>10}{'start-up+teardown s':>22}{'range':>14}{'samples/s':>11}{'range':>14}{'vs local':>10}")
    base_sps = statistics.median(results["local"]["sps"])
    for name, r in results.items():
        o, s = r["overhead"], r["sps"]
        print(f"{name:>10}{statistics.median(o):>22.1f}{f'{min(o):.1f}-{max(o):.1f}':>14}"
              f"{statistics.median(s):>11.1f}{f'{min(s):.1f}-{max(s):.1f}':>14}{statistics.median(s) / base_sps:>9.2f}x")


if __name__ == "__main__":
    main()

"""What recording trajectories (``RUN_DIR/trajectories.mtr``) costs per RL step, ``metrics.trajectories``
``all`` vs ``best_worst`` (prints tables; not a test).

    .venv/bin/python bench/record_overhead.py            # both parts below
    .venv/bin/python bench/record_overhead.py --quick    # smoke: fewer repeats, fewer steps
    .venv/bin/python bench/record_overhead.py --part synthetic --rows 256 --tokens 8000

Two parts, each A/B interleaved (all, best_worst, all, best_worst, ...):

- ``synthetic``: :meth:`TrajectoryRecorder.write_step` alone (encode, compress, one write) on a
  step of ``--rows`` trajectories of ``--tokens`` tokens each, with a conversation and commands
  and the trainer's log-probs for the kept rows, a byte-level decode for the pieces. Per variant:
  median and range of ms per step and MB per step over ``--repeats`` steps.
- ``run``: the tiny-terminal recipe (no SFT, in-process trainer, sync rollouts), each run a fresh
  ``miles train`` process of ``--steps`` steps; per run the median of ``time/record_trajectories``
  and its share of the step (``time/record_trajectories`` / sum of the ``time/*`` split), and
  ``metrics/trajectory_bytes`` per step; medians and ranges over ``--pairs`` runs of each.

Measured on the 2-core CPU dev box (shared with a CI run), default arguments:

    synthetic (64 x 2000 tokens)  all: 178 ms [170, 209], 1.33 MB   best_worst: 12.5 ms [12.1, 12.9], 0.065 MB
    tiny-terminal (16 per step)   all: 14.1 ms [14.1, 14.7], 4.5 % [3.7, 4.6] of the step, 36.6 KB
                                  best_worst: 7.7 ms [6.9, 12.7], 2.0 % [1.9, 3.0], 9.9 KB
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miles_engine.metrics.trajectory_recorder import TrajectoryRecorder  # noqa: E402
from miles_engine.rollout.types import Group, Trajectory  # noqa: E402

VARIANTS = ("all", "best_worst")


def _fmt(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):.{digits}f} [{min(v):.{digits}f}, {max(v):.{digits}f}]"


# ====================================================================================== synthetic
def synthetic_step(rows: int, tokens: int, group_size: int, seed: int) -> list[Group]:
    rng = random.Random(seed)
    groups = []
    for g in range(rows // group_size):
        gid = f"task-{g}@{seed}"
        trajs = []
        for i in range(group_size):
            prompt = tokens // 4
            ids = [rng.randrange(32000) for _ in range(tokens)]
            mask = [0] * prompt + [1 if (j // 200) % 3 else 0 for j in range(tokens - prompt)]
            trajs.append(Trajectory(
                token_ids=ids, loss_mask=mask, rollout_logprobs=[-rng.random() * 3 if m else 0.0 for m in mask],
                weight_versions=[7 if m else None for m in mask], reward=float(rng.random() < 0.5),
                task_id=f"task-{g}", group_id=gid, index=i, tags={"kind": "synthetic"},
                metrics={"turns": 4.0, "tool_calls": 3.0},
                transcript={"messages": [{"role": "user", "content": "x" * 2000}] * 8,
                            "commands": [{"command": "make test", "exit_code": 1, "duration_s": 1.5, "started_s": 3.0,
                                          "truncated": False, "output": "y" * 4000}] * 3}))
        groups.append(Group(gid, f"task-{g}", trajs, submitted_version=7))
    return groups


def run_synthetic(args: argparse.Namespace) -> None:
    def decode(ids: list[int]) -> str:
        return bytes([ids[0] % 95 + 32]).decode() * (1 + ids[0] % 4)

    steps = [synthetic_step(args.rows, args.tokens, args.group_size, seed) for seed in range(args.repeats)]
    out: dict[str, dict[str, list[float]]] = {v: {"s": [], "bytes": [], "records": []} for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        recorders = {v: TrajectoryRecorder(Path(tmp) / v, v, seed=0, decode=decode) for v in VARIANTS}
        for n, groups in enumerate(steps):
            for v in VARIANTS if n % 2 == 0 else VARIANTS[::-1]:  # interleaved, alternating first
                rec = recorders[v]
                keep = rec.bodies(n + 1, groups)
                rows = {k: {"advantage": 0.5, "trainer_logprobs": [-1.0] * args.tokens} for k in keep}
                done = rec.write_step(n + 1, 7, groups, keep, rows, {})
                out[v]["s"].append(done.seconds)
                out[v]["bytes"].append(done.bytes)
                out[v]["records"].append(done.records)
        for rec in recorders.values():
            rec.close()
    print(f"\nsynthetic: write_step on {args.rows} trajectories x {args.tokens} tokens, {args.repeats} steps each "
          f"(median [min, max])")
    print(f"{'variant':<12} {'ms / step':>26} {'MB / step':>24} {'bodies':>7}")
    for v in VARIANTS:
        bodies = args.rows if v == "all" else 2
        print(f"{v:<12} {_fmt(out[v]['s'], 1e3, 1):>26} {_fmt(out[v]['bytes'], 1e-6, 3):>24} {bodies:>7}")


# ====================================================================================== real runs
RUN = ["sft.enabled=false", "tokenizer.corpus_demos=300", "rollout.mode=sync", "placement.trainer=in_process",
       "rollout.group_size=4", "rollout.groups_per_step=4", "rollout.max_inflight=16", "buffer.capacity_groups=8",
       "run.max_minutes=null", "run.checkpoint_every=0", "metrics.progress=false", "eval.every=null"]


def one_run(out: Path, name: str, variant: str, steps: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "miles_engine.cli.main", "train", "tiny-terminal", *RUN, f"run.steps={steps}",
           f"metrics.trajectories={variant}", f"run.out_dir={out}", f"run.name={name}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"][1:]  # step 1 pays the first-use costs
    rec = [r["time/record_trajectories"] for r in train]
    split = [sum(v for k, v in r.items() if k.startswith("time/") and k != "time/elapsed") for r in train]
    share = [r["time/record_trajectories"] / total for r, total in zip(train, split)]
    return {"ms": statistics.median(rec) * 1e3, "share": statistics.median(share),
            "kb": statistics.median(r["metrics/trajectory_bytes"] for r in train) / 1e3,
            "records": statistics.median(r["metrics/trajectory_records"] for r in train)}


def run_runs(args: argparse.Namespace) -> None:
    got: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for p in range(args.pairs):
            for v in VARIANTS if p % 2 == 0 else VARIANTS[::-1]:
                t0 = time.time()
                got[v].append(one_run(Path(tmp), f"{v}-{p}", v, args.steps))
                print(f"  run {v}-{p}: {time.time() - t0:.0f} s, {got[v][-1]}", flush=True)
    print(f"\nrun: tiny-terminal, 16 trajectories per step, {args.steps} steps per run (step 1 left out), "
          f"{args.pairs} runs each (median [min, max] of the per-run medians)")
    print(f"{'variant':<12} {'record ms / step':>22} {'share of step %':>20} {'KB / step':>22} {'records':>8}")
    for v in VARIANTS:
        r = got[v]
        print(f"{v:<12} {_fmt([x['ms'] for x in r], 1, 2):>22} {_fmt([x['share'] for x in r], 100, 2):>20} "
              f"{_fmt([x['kb'] for x in r], 1, 1):>22} {statistics.median(x['records'] for x in r):>8.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("synthetic", "run", "both"), default="both")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.pairs, args.steps = 4, 1, 3
    import torch

    torch.set_num_threads(1)
    if args.part in ("synthetic", "both"):
        run_synthetic(args)
    if args.part in ("run", "both"):
        run_runs(args)


if __name__ == "__main__":
    main()

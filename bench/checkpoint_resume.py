"""Checkpoint write time and resume time for the ``tiny-terminal`` recipe (prints a table; not a test).

    .venv/bin/python bench/checkpoint_resume.py              # 6 RL steps, checkpoint every step, 3 resumes
    .venv/bin/python bench/checkpoint_resume.py --resumes 1  # quicker

The recipe as shipped (fully_async, trainer in its own process, separate SFT optimizer, so the
checkpoint holds the model, both AdamW states and both LR schedules), with a short SFT warm start
(``sft.demos=256``, 1 epoch) so the run reaches RL quickly. Reported:

- ``checkpoint/write_s`` per step: the whole cost to the training loop (trainer state fetched from
  the trainer process, torch.save, every file fsynced, rename), with ``checkpoint/state_s`` (the
  fetch alone) and the checkpoint's size;
- resume: ``checkpoint/restore_s`` (read + check the checkpoint, load it into the trainer process,
  restore the buffer, RNGs and consumed log) and the wall time from ``miles train --resume`` to its
  first RL step, against the same measure for a fresh run without SFT (the start-up floor).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MILES = [sys.executable, "-m", "miles_engine.cli.main", "train"]
BASE = ["metrics.progress=false", "run.checkpoint_every=1", "sft.demos=256", "sft.epochs=1",
        "trainer.sft.lr_schedule.total_steps=8", "trainer.sft.lr_schedule.warmup_steps=2"]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]


def time_to_first_step(args: list[str], run: Path) -> tuple[float, float]:
    """Run ``miles train ARGS``; seconds from start until a new train row appears, and total."""
    before = sum(r["kind"] == "train" for r in rows(run)) if (run / "metrics.jsonl").exists() else 0
    t0 = time.perf_counter()
    proc = subprocess.Popen(MILES + args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    first = None
    while proc.poll() is None:
        if first is None and (run / "metrics.jsonl").exists() and \
                sum(r["kind"] == "train" for r in rows(run)) > before:
            first = time.perf_counter() - t0
        time.sleep(0.05)
    if proc.returncode != 0:
        raise SystemExit(f"miles train {' '.join(args)} failed with exit code {proc.returncode}")
    return first if first is not None else float("nan"), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--resumes", type=int, default=3)
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    run = out / "r"
    time_to_first_step(["tiny-terminal", *BASE, f"run.steps={args.steps}", f"run.out_dir={out}", "run.name=r"], run)
    fresh, _ = time_to_first_step(["tiny-terminal", *BASE, "sft.enabled=false", "run.steps=1",
                                   f"run.out_dir={out}", "run.name=fresh"], out / "fresh")
    resumes = []
    for i in range(args.resumes):
        first, _ = time_to_first_step(["--resume", str(run), f"run.steps={args.steps + i + 1}"], run)
        resumes.append(first)
    train = [r for r in rows(run) if r["kind"] == "train"]
    write = [r["checkpoint/write_s"] for r in train if "checkpoint/write_s" in r]
    state = [r["checkpoint/state_s"] for r in train if "checkpoint/state_s" in r]
    size = max(r.get("checkpoint/bytes", 0) for r in train)
    restore = [r["checkpoint/restore_s"] for r in train if "checkpoint/restore_s" in r]
    med = statistics.median
    print(f"tiny-terminal checkpoint ({size / 2**20:.1f} MiB: model + 2 AdamW states + schedules + rollout state)")
    print("| measure | median | min | max | n |\n|---|---|---|---|---|")
    for name, vals in [("checkpoint/write_s (loop cost)", write), ("  of which trainer state fetch", state),
                       ("checkpoint/restore_s", restore), ("resume: process start -> first RL step (s)", resumes),
                       ("fresh run, no SFT: start -> first RL step (s)", [fresh])]:
        print(f"| {name} | {med(vals):.3f} | {min(vals):.3f} | {max(vals):.3f} | {len(vals)} |")
    print(f"run directory: {run}")


if __name__ == "__main__":
    main()

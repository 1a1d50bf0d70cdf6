"""The co-trained speculative draft on ``tiny-terminal`` (prints tables; not a test).

    .venv/bin/python bench/draft_training.py                       # 2 repeats x 3 variants, 16 steps each
    .venv/bin/python bench/draft_training.py --warm RUN_DIR        # reuse a warm run (SFT done)
    .venv/bin/python bench/draft_training.py --steps 24 --repeats 3

From the recipe's SFT weights (a warm run made once: SFT + one RL step, as the tests' ``warm_run``),
each variant resumes a copy for ``--steps`` RL steps, differing only in the embedded engine's
``speculative`` section:

- ``off``: no speculation;
- ``draft``: a small draft (``tiny:`` spec, the policy's vocabulary) that is never trained: chance;
- ``co-trained``: the same draft with ``train: true`` (trained every step on the policy's samples).

Per variant (medians over repeats of the per-run medians over the last half of the steps, with
ranges): acceptance length, engine output tokens/s, step wall time and samples/s (the net effect), the
policy's time/train and the draft's time/train_draft (the update overhead; the draft trains beside
the policy's step, so only what exceeds it lengthens the step). Runs are interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRAFT = "tiny:qwen3,hidden_size=64,num_hidden_layers=1,intermediate_size=128"
SPEC = "engines.0.options.speculative"
VARIANTS = {
    "off": [],
    "draft": [f"{SPEC}.method=draft", f"{SPEC}.draft_model={DRAFT}", f"{SPEC}.num_tokens=3"],
    "co-trained": [f"{SPEC}.method=draft", f"{SPEC}.draft_model={DRAFT}", f"{SPEC}.num_tokens=3",
                   f"{SPEC}.train=true", f"{SPEC}.train_lr=0.003", f"{SPEC}.train_epochs=4"],
}
COLUMNS = ("engine/spec_acceptance_length", "engine/output_tokens_per_s", "step_s", "samples_per_s",
           "time/train", "time/train_draft")


def miles(*args: str, timeout: float = 3600) -> None:
    proc = subprocess.run([sys.executable, "-m", "miles_engine.cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode:
        raise SystemExit(f"miles {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def warm_run(out: Path) -> Path:
    miles("train", "tiny-terminal", "run.steps=1", "run.max_minutes=null", "metrics.progress=false",
          f"run.out_dir={out}", "run.name=warm")
    return out / "warm"


def one(warm: Path, dest: Path, steps: int, overrides: list[str]) -> dict[str, float]:
    shutil.copytree(warm, dest)
    shutil.rmtree(dest / "checkpoints" / "step_00000001")  # from the SFT weights
    (dest / "metrics.jsonl").write_text("")
    miles("train", "--resume", str(dest), *overrides, f"run.steps={steps}", "run.max_minutes=null",
          "metrics.progress=false", "run.checkpoint_every=0")
    rows = [json.loads(line) for line in (dest / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    for prev, row in zip(train, train[1:]):  # a step's wall time: between two logged steps
        row["step_s"] = row["time/elapsed"] - prev["time/elapsed"]
        row["samples_per_s"] = row["rollout/num_samples"] / row["step_s"]
    last = train[steps // 2:]
    return {key: statistics.median(r[key] for r in last) if all(key in r for r in last) else float("nan")
            for key in COLUMNS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm", type=Path, help="a warm run dir (default: made once here)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="draft-bench-") as tmp:
        warm = args.warm or warm_run(Path(tmp))
        results: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
        for r in range(args.repeats):
            for name, overrides in VARIANTS.items():  # interleaved
                results[name].append(one(warm, Path(tmp) / f"{name}-{r}", args.steps, overrides))
                print(f"repeat {r} {name}: " + ", ".join(f"{k}={v:.3g}" for k, v in results[name][-1].items()),
                      flush=True)
    base = statistics.median(x["samples_per_s"] for x in results["off"])
    print(f"\ntiny-terminal, {args.steps} RL steps from the SFT weights, last half; median [min-max] of "
          f"{args.repeats} runs\n")
    print("| variant | " + " | ".join(COLUMNS) + " | samples/s vs off |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for name, runs in results.items():
        cells = []
        for key in COLUMNS:
            values = [x[key] for x in runs]
            cells.append(f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]")
        ratio = statistics.median(x["samples_per_s"] for x in runs) / base
        print(f"| {name} | " + " | ".join(cells) + f" | {ratio:.2f}x |")


if __name__ == "__main__":
    main()

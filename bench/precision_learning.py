"""The learning curve under the precision contract against full precision (prints a table; not a test).

    .venv/bin/python bench/precision_learning.py                      # makes the SFT warm start first
    .venv/bin/python bench/precision_learning.py --warm RUN_DIR       # one made earlier (make_warm_run)

tiny-terminal from its SFT weights (the warm run's step-0 checkpoint), 30 RL steps, sync rollouts,
the same seed for every configuration, held-out reward (32 drills x 4 attempts, the same drills each
time) at steps 0, 10, 20 and 30:

- ``full``: full-precision train and serve;
- ``fp8 serve``: ``precision.rollout=fp8 precision.kv_cache=fp8`` (FP8 weights and KV cache in the
  engine, full-precision training: the mismatch correction sees the gap);
- ``mxfp8 QAT``: ``precision.train=mxfp8 precision.rollout=mxfp8`` (the trainer's forward computes
  with the engine's MXFP8 values).
Per configuration: the curve, the last evaluation's paired difference to full precision's (same
drills) with its 95% interval, and the mean train-rollout log-prob gap over the run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.run.fleet_helpers import make_warm_run  # noqa: E402

CONFIGS = {"full": [], "fp8 serve": ["precision.rollout=fp8", "precision.kv_cache=fp8"],
           "mxfp8 QAT": ["precision.train=mxfp8", "precision.rollout=mxfp8"]}
STEPS = 30
EVAL = ["eval.limit=32", "eval.attempts=4"]


def _curve(run: Path) -> list[tuple[int, float, dict]]:
    from miles_engine.evaluation.runner import per_task_values, read_records

    out = []
    for f in sorted((run / "eval").glob("step_*.jsonl")):
        values = per_task_values(read_records(f))
        out.append((int(f.stem.removeprefix("step_")), statistics.mean(values.values()), values))
    return out


def _rl_from_sft_weights(warm: Path, run: Path, steps: int, *overrides: str) -> list[dict]:
    """tests/run/learning.rl_from_sft_weights with this bench's evaluation interval."""
    import json
    import shutil

    from click.testing import CliRunner

    from miles_engine.cli.main import cli

    shutil.copytree(warm, run)
    shutil.rmtree(run / "checkpoints" / "step_00000001")  # from the SFT weights
    (run / "metrics.jsonl").write_text("")
    result = CliRunner().invoke(cli, ["train", "--resume", str(run), *overrides, f"run.steps={steps}",
                                      "run.max_minutes=null", "metrics.progress=false"], catch_exceptions=False)
    if result.exit_code != 0:
        sys.exit(result.output[-3000:])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", type=Path, default=None, help="a warm run directory (make_warm_run)")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    from miles_engine.evaluation import stats

    with tempfile.TemporaryDirectory(prefix="precision-learning-") as tmp:
        warm = args.warm or make_warm_run(Path(tmp) / "warm-start")
        curves, gaps = {}, {}
        for name, overrides in CONFIGS.items():
            run = Path(tmp) / name.replace(" ", "-")
            every = max(args.steps // 3, 1)
            train = _rl_from_sft_weights(warm, run, args.steps, *overrides, "rollout.mode=sync",
                                        f"run.checkpoint_every={args.steps}", f"eval.every={every}", *EVAL)
            curves[name] = _curve(run)
            gaps[name] = statistics.mean(r.get("tis/numerics_abs_diff", 0.0) for r in train)
    steps = [s for s, _, _ in curves["full"]]
    print(f"tiny-terminal from SFT weights, {args.steps} RL steps, sync; held-out reward (32 drills x 4) at steps {steps}")
    print(f"{'config':10} {'held-out reward curve':34} {'last - full (95% CI)':26} mean |train-rollout dlogp|")
    full_last = curves["full"][-1][2]
    for name, curve in curves.items():
        shown = " ".join(f"{r:.3f}" for _, r, _ in curve)
        if name == "full":
            vs = "-"
        else:
            d = stats.paired_difference(curve[-1][2], full_last)
            vs = f"{d.value:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"
        print(f"{name:10} {shown:34} {vs:26} {gaps[name]:.4f}")


if __name__ == "__main__":
    main()

"""The learning check of the tiny-terminal end-to-end tests: the held-out reward at the run's last
evaluation against the one at its first (the same 32 held-out drills x 4 attempts each time, so the
difference is paired per drill), with its 95% interval above 0.

Why not the training reward: each step trains 8 groups of 8 new tasks, and the step's mean reward
swings by ~0.15 with those tasks' difficulty. Over 30 steps of the recipe the old bar, a 3-step
moving average rising by 0.3, measured 0.29-0.56 on 16 learning runs (it failed CI once at 0.286),
while the same curves shuffled (no trend left) reached 0.37 one time in 100: a bar that fails
learning runs and would pass flat ones. The paired held-out difference measured +0.33 to +0.48 at
step 30 in the five tests using it (standard errors 0.066-0.076): interval lower bounds 0.18-0.35.
The training reward's moving average is still printed when the check fails."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from click.testing import CliRunner

from miles_engine.cli.main import cli
from miles_engine.report import moving_average

# held-out evaluations at the run's first step (eval.at_start) and at step 30, in the run's own engines
EVAL_FIRST_AND_LAST = ["eval.every=30", "eval.limit=32", "eval.attempts=4"]


def assert_held_out_rise(run: Path, train: list[dict], where: str = "") -> None:
    """The run learned: held-out reward at its last evaluation minus its first, paired over the
    drills, with a 95% interval above 0. ``train``: the run's train rows (for the message)."""
    from miles_engine.evaluation import stats
    from miles_engine.evaluation.runner import per_task_values, read_records

    files = sorted((run / "eval").glob("step_*.jsonl"))
    assert len(files) >= 2, f"{run / 'eval'}: two held-out evaluations expected, found {[f.name for f in files]}"
    first, last = (read_records(f) for f in (files[0], files[-1]))
    assert all(r.ok for r in first + last), "a held-out episode failed"
    diff = stats.paired_difference(per_task_values(last), per_task_values(first))
    _, ma = moving_average([r["step"] for r in train], [r["reward/mean"] for r in train])
    assert diff.n == 32, diff
    assert diff.low > 0, (f"held-out reward did not rise{where} ({files[0].stem} -> {files[-1].stem}: "
                          f"{diff}); training reward, 3-step moving average: {[round(x, 3) for x in ma]}")


def rl_from_sft_weights(warm_run: Path, run: Path, steps: int, *overrides: str) -> list[dict]:
    """A copy of the shared ``warm_run`` resumed from its step-0 checkpoint (the SFT weights, before
    any rollout) for ``steps`` RL steps with ``overrides``, evaluated first and last; its train rows."""
    shutil.copytree(warm_run, run)
    shutil.rmtree(run / "checkpoints" / "step_00000001")  # from the SFT weights
    (run / "metrics.jsonl").write_text("")  # this run's rows only
    args = ["train", "--resume", str(run), *overrides, f"run.steps={steps}", "run.max_minutes=null",
            "metrics.progress=false", *EVAL_FIRST_AND_LAST]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == steps, [r.get("step") for r in train]
    return train

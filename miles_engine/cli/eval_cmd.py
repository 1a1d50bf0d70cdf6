"""``miles eval RECIPE [--checkpoint CKPT [--checkpoint CKPT2]]``: evaluate a recipe's agent, or
checkpoints' weights, on its eval task set; two checkpoints are compared task by task."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import click

from miles_engine.cli.common import cli_hub, console, echo_json, table
from miles_engine.hub import Hub
from miles_engine.config.recipe import RecipeConfig, load_recipe
from miles_engine.evaluation.runner import AttemptRecord, write_records
from miles_engine.run.evaluate import EvalRun, compare, evaluate, evaluate_checkpoints


async def _evaluate(hub: Hub, cfg: RecipeConfig) -> list[AttemptRecord]:
    """The recipe's agent over its eval tasks (one record per attempt)."""
    return (await evaluate(hub, cfg)).records


def _fmt(metrics: dict[str, float], name: str) -> str:
    value = metrics.get(f"eval/{name}")
    if value is None or math.isnan(value):
        return "-"
    low, high = metrics.get(f"eval/{name}_ci_low", math.nan), metrics.get(f"eval/{name}_ci_high", math.nan)
    return f"{value:.3f} [{low:.3f}, {high:.3f}]"


def _print_run(run: EvalRun, ks: list[int], show_attempts: bool) -> None:
    if show_attempts:
        console().print(table(None, ["task", "attempt", "reward", "turns", "stop", "error"],
                              ([r.task_id, r.attempt, r.reward, r.turns, r.stop_reason or "",
                                f"{r.error_kind}: {r.error}" if r.error_kind else ""] for r in run.records)))
    m = run.metrics
    where = f" (step {run.step}, weights v{run.weight_version})" if run.step is not None else ""
    click.echo(f"{run.label}{where}: {run.info.get('tasks', '')}")
    click.echo(f"  mean reward {_fmt(m, 'reward')} over {int(m['eval/tasks_scored'])} scored tasks "
               f"({int(m['eval/scored'])} scored attempts); {int(m['eval/errors'])} errors, not scored"
               + "".join(f"; pass@{k} {_fmt(m, f'pass@{k}')}" for k in ks))


@click.command("eval")
@click.argument("recipe")
@click.argument("overrides", nargs=-1)
@click.option("--checkpoint", "checkpoints", multiple=True, type=click.Path(exists=True, file_okay=False,
              path_type=Path), help="Evaluate this checkpoint's weights (RUN_DIR/checkpoints/step_N); twice: "
              "compare the second against the first on the same tasks.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write one JSONL of per-attempt results per evaluation here.")
@click.option("--json", "as_json", is_flag=True)
def eval_cmd(recipe: str, overrides: tuple[str, ...], checkpoints: tuple[Path, ...], out_dir: Path | None,
             as_json: bool) -> None:
    """Evaluate RECIPE's agent (KEY=VALUE overrides, e.g. eval.jobs=8), or with --checkpoint the
    weights of a training checkpoint (pass the run's RUN_DIR/config.yaml as RECIPE)."""
    if len(checkpoints) > 2:
        raise click.UsageError("give --checkpoint at most twice (the second is compared against the first)")
    hub = cli_hub()
    cfg = load_recipe(recipe, list(overrides), hub=hub)
    if checkpoints:
        runs = asyncio.run(evaluate_checkpoints(hub, cfg, list(checkpoints)))
    else:
        runs = [asyncio.run(evaluate(hub, cfg))]
    diff = compare(runs[1], runs[0], cfg) if len(runs) == 2 else None
    if out_dir is not None:
        for i, run in enumerate(runs):
            name = f"step_{run.step:06d}.jsonl" if run.step is not None else f"eval_{i}.jsonl"
            write_records(out_dir / name, run.records, step=run.step, weight_version=run.weight_version)
    if as_json:
        report = {"runs": [{"label": r.label, "step": r.step, "weight_version": r.weight_version,
                            "metrics": r.metrics, "episodes": [x.to_dict() for x in r.records]} for r in runs]}
        report.update(mean_reward=runs[0].metrics["eval/reward"], episodes=report["runs"][0]["episodes"])
        if diff is not None:
            report["difference"] = {k: v.to_dict() for k, v in diff.items()}
        echo_json(json.loads(json.dumps(report, default=float, allow_nan=True)))
    else:
        for run in runs:
            _print_run(run, cfg.eval.ks, show_attempts=len(runs) == 1)
        if diff is not None:
            d = diff["reward"]
            verdict = ("training helped: the 95% interval is above 0" if d.low > 0 else
                       "training hurt: the 95% interval is below 0" if d.high < 0 else
                       "no significant difference: the 95% interval contains 0")
            click.echo(f"difference (second - first) over {d.n} shared tasks: reward {d.value:+.3f} "
                       f"[{d.low:+.3f}, {d.high:+.3f}] (se {d.se:.3f}); pass@1 {diff['pass@1'].value:+.3f} "
                       f"[{diff['pass@1'].low:+.3f}, {diff['pass@1'].high:+.3f}]; {verdict}")
    if not any(rec.reward is not None for r in runs for rec in r.records):
        # no tasks, or every attempt's grading failed: nothing was evaluated
        click.echo("no attempt was scored", err=True)
        sys.exit(1)

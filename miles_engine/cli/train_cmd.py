"""``miles train RECIPE [key=value ...] [--resume RUN_DIR]``."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import click

from miles_engine.cli.common import cli_hub
from miles_engine.config.recipe import load_recipe, resolve_recipe_path


def _run_dir(recipe: str, out_dir: str, name: str | None) -> Path:
    stem = Path(resolve_recipe_path(recipe, hub=cli_hub())).stem
    return Path(out_dir) / (name or f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}")


@click.command("train")
@click.argument("recipe", required=False)
@click.argument("overrides", nargs=-1)
@click.option("--resume", "resume_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Continue the run in this directory from its newest checkpoint (recipe from its config.yaml).")
def train(recipe: str | None, overrides: tuple[str, ...], resume_dir: Path | None) -> None:
    """Train a policy with the recipe RECIPE (a packaged name or a YAML path)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from miles_engine.run.driver import run_recipe
    from miles_engine.run.training import TrainingRun

    if resume_dir is not None:
        if recipe is not None and "=" in recipe:  # with --resume every argument is an override
            overrides = (recipe, *overrides)
        recipe = str(resume_dir / "config.yaml")
    if recipe is None:
        raise click.UsageError("give a RECIPE (or --resume RUN_DIR)")
    hub = cli_hub()
    cfg = load_recipe(recipe, list(overrides), hub=hub)
    run_dir = resume_dir or _run_dir(recipe, cfg.run.out_dir, cfg.run.name)
    click.echo(f"run directory: {run_dir}")

    async def main() -> int:
        task = asyncio.current_task()
        run: TrainingRun | None = None

        def on_interrupt(name: str) -> None:  # first signal: finish the step and checkpoint; second: abort now
            if (run is None or run.stop_requested) and task is not None:
                task.cancel()
                return
            run.stop_requested = True
            click.echo(f"\n{name}: stopping after the current step (again to abort without a checkpoint)", err=True)

        # SIGTERM (a scheduler's or `kill`'s stop) as Ctrl-C: its default would end the driver at once and
        # leave its engine, trainer and sandbox processes running
        for sig, name in ((signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")):
            asyncio.get_running_loop().add_signal_handler(sig, on_interrupt, name)
        def started(r: TrainingRun) -> None:
            nonlocal run
            run = r

        return await run_recipe(cfg, run_dir, hub=hub, resume=resume_dir is not None, on_start=started)

    try:
        last = asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        click.echo(f"\naborted; resume from the last checkpoint with: miles train --resume {run_dir}", err=True)
        raise SystemExit(130) from None
    click.echo(f"stopped at step {last}; report: miles report {run_dir}; continue: miles train --resume {run_dir}")

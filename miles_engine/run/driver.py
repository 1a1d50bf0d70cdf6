"""The training loop, and the program around it. The loop reads like pseudocode; every variant
lives in the run's components (the rollout mode's hooks, the evaluator, the transport)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from miles_engine.config.recipe import RecipeConfig
from miles_engine.hub import Hub
from miles_engine.run.compose import compose
from miles_engine.run.training import TrainingRun


async def run_recipe(cfg: RecipeConfig, run_dir: Path, *, hub: Hub, resume: bool = False,
                     on_start: Callable[[TrainingRun], None] | None = None) -> int:
    """Compose the recipe's components, drive the run, tear everything down; the last step.
    ``on_start(run)`` sees the run before its first step (signal handlers, tests)."""
    async with compose(cfg, run_dir, hub=hub, resume_run=resume) as parts:
        run = await TrainingRun(parts).restore()
        if on_start is not None:
            on_start(run)
        return await drive(run)


async def drive(run: TrainingRun) -> int:
    """Warm start, push the trainer's weights, then {get groups, train, checkpoint, push, evaluate}."""
    await run.warm_start()
    if run.stop_requested:  # stopped during SFT: its own checkpoint is written, RL has not begun
        return run.step
    await run.maybe_checkpoint(run.step)  # resumable from the first RL step (no-op when resumed)
    await run.push_weights()  # engines start from the trainer's own (or the restored) weights and version
    await run.evaluate(run.step, run.version)  # eval.at_start: the starting weights
    if run.cfg.run.steps:  # run.steps 0: an SFT-only run starts no rollouts
        await run.mode.start()
    step = run.step
    for step in run.steps():
        groups = await run.next_groups(step)
        await run.mode.before_train(step)
        metrics = await run.train(step, groups)
        await run.maybe_checkpoint(step)
        version = await run.push_weights()
        await run.mode.after_push(version)
        await run.record_trajectories(step, groups)  # RUN_DIR/trajectories.mtr
        run.log(step, groups, metrics)
        await run.evaluate(step, version)  # every eval.every steps (eval/*, RUN_DIR/eval/)
        if run.should_stop():
            break
    await run.maybe_checkpoint(step, final=True)
    return step

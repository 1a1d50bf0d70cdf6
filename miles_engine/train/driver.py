"""The training loop. It reads like pseudocode; every variant lives in the run's components."""

from __future__ import annotations

from miles_engine.train.run import TrainingRun


async def train(run: TrainingRun) -> int:
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
        run.log(step, groups, metrics)
        await run.evaluate(step, version)  # every eval.every steps (eval/*, RUN_DIR/eval/)
        if run.should_stop():
            break
    await run.maybe_checkpoint(step, final=True)
    return step

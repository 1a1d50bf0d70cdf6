"""The training loop. It reads like pseudocode; every variant lives in the stack's components."""

from __future__ import annotations

from miles_engine.train.stack import TrainingStack


async def train(stack: TrainingStack) -> int:
    """Warm start, push the trainer's weights, then {get groups, train, checkpoint, push}."""
    await stack.warm_start()
    await stack.maybe_checkpoint(stack.step)  # resumable from the first RL step (no-op when resumed)
    await stack.push_weights()  # engines start from the trainer's own (or the restored) weights and version
    await stack.evaluator.after_step(stack.step, stack.version)  # eval.at_start: the starting weights
    await stack.mode.start()
    step = stack.step
    for step in stack.steps():
        groups = await stack.next_groups(step)
        await stack.mode.before_train(step)
        metrics = await stack.train(step, groups)
        await stack.maybe_checkpoint(step)
        version = await stack.push_weights()
        await stack.mode.after_push(version)
        stack.log(step, groups, metrics)
        await stack.evaluator.after_step(step, version)  # every eval.every steps (eval/*, RUN_DIR/eval/)
        if stack.should_stop():
            break
    await stack.maybe_checkpoint(step, final=True)
    return step

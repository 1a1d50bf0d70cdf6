"""The supervised warm start: fresh noisy demonstrations → exact token rows → SFT steps
(``sft.dataset``: transcripts from a data file instead, :mod:`.dataset_run`)."""

from __future__ import annotations

from miles_engine.environments.capabilities import demonstrations
from miles_engine.sft.config import SFTInputs
from miles_engine.sft.dataset_run import run_sft_dataset
from miles_engine.sft.loop import demo_rows, shuffled_batches, step_count, stopper


async def run_sft(inputs: SFTInputs) -> None:
    recipe, cfg = inputs.cfg, inputs.cfg.sft
    if cfg.dataset is not None:
        return await run_sft_dataset(inputs)
    demos = demonstrations(inputs.source, cfg.demos, seed=recipe.seed + 1, wrong_fraction=cfg.wrong_fraction)
    rows = demo_rows(inputs.codec, demos)
    steps = step_count(len(rows), epochs=cfg.epochs, batch_size=cfg.batch_size)
    inputs.metrics.set_total(steps, kind="sft")
    should_stop = stopper(inputs.stop, cfg.max_minutes)
    for step, batch in shuffled_batches(len(rows), batch_size=cfg.batch_size, steps=steps, seed=recipe.seed):
        metrics = await inputs.trainer.sft_step([rows[i] for i in batch])
        inputs.metrics.log(step, {f"sft/{k}": v for k, v in metrics.items()}, kind="sft")
        if should_stop():
            break
    inputs.metrics.set_total(recipe.run.steps, kind="train")

"""The supervised warm start: fresh noisy demonstrations → exact token rows → SFT steps."""

from __future__ import annotations

import asyncio
import math
import random
import time
from typing import TYPE_CHECKING

from miles_engine.train.sft_rows import conversation_row

if TYPE_CHECKING:
    from miles_engine.train.stack import TrainingStack


async def run_sft(stack: TrainingStack) -> None:
    from miles_engine.train.stack import demonstrations
    from miles_engine.trainer.rows import SFTRow

    cfg = stack.cfg.sft
    if cfg.dataset is not None:
        from miles_engine.train.sft_dataset_run import run_sft_dataset

        return await run_sft_dataset(stack)
    demos = demonstrations(stack.source, cfg.demos, seed=stack.cfg.seed + 1, wrong_fraction=cfg.wrong_fraction)
    rows = [SFTRow(*conversation_row(stack.codec, d.prompt, d.messages, d.tools)) for d in demos]
    steps = max(1, math.ceil(len(rows) * cfg.epochs / cfg.batch_size))
    rng = random.Random(stack.cfg.seed)
    order: list[int] = []
    stack.metrics.set_total(steps, kind="sft")
    started = time.monotonic()
    for step in range(1, steps + 1):
        if len(order) < cfg.batch_size:
            fresh = list(range(len(rows)))
            rng.shuffle(fresh)
            order += fresh
        batch, order = [rows[i] for i in order[:cfg.batch_size]], order[cfg.batch_size:]
        metrics = await asyncio.to_thread(stack.trainer.sft_step, batch)
        stack.metrics.log(step, {f"sft/{k}": v for k, v in metrics.items()}, kind="sft")
        if stack.stop_requested or (cfg.max_minutes is not None and time.monotonic() - started > cfg.max_minutes * 60):
            break
    stack.metrics.set_total(stack.cfg.run.steps, kind="train")

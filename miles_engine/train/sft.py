"""The supervised warm start: fresh noisy demonstrations → exact token rows → SFT steps."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_engine.train.sft_rows import conversation_row


@dataclass(frozen=True)
class SFTInputs:
    """What the warm start uses, and nothing else."""

    cfg: Any  # RecipeConfig: sft, seed, run.steps
    trainer: Any  # TrainerAccess
    codec: Any
    source: Any  # an environment with demonstrations
    metrics: Any  # MetricsLogger
    stop: Callable[[], bool] = lambda: False
    # sft.dataset runs (their own checkpoints and exact resume, held-out eval loss):
    run_dir: Path | None = None
    tokenizer_sha: str = ""
    policy: Any = None  # the policy's model or path (the eval loss scores a copy)
    resume_sft: bool = False  # --resume of a run stopped during SFT
    resume_rules: tuple[Any, ...] = ()  # the run's own conditions on resuming SFT (checkpoint.compat.check)


async def run_sft(inputs: SFTInputs) -> None:
    from miles_engine.train.model_build import demonstrations
    from miles_engine.trainer.rows import SFTRow

    recipe, cfg = inputs.cfg, inputs.cfg.sft
    if cfg.dataset is not None:
        from miles_engine.train.sft_dataset_run import run_sft_dataset

        return await run_sft_dataset(inputs)
    demos = demonstrations(inputs.source, cfg.demos, seed=recipe.seed + 1, wrong_fraction=cfg.wrong_fraction)
    rows = [SFTRow(*conversation_row(inputs.codec, d.prompt, d.messages, d.tools)) for d in demos]
    steps = max(1, math.ceil(len(rows) * cfg.epochs / cfg.batch_size))
    rng = random.Random(recipe.seed)
    order: list[int] = []
    inputs.metrics.set_total(steps, kind="sft")
    started = time.monotonic()
    for step in range(1, steps + 1):
        if len(order) < cfg.batch_size:
            fresh = list(range(len(rows)))
            rng.shuffle(fresh)
            order += fresh
        batch, order = [rows[i] for i in order[:cfg.batch_size]], order[cfg.batch_size:]
        metrics = await inputs.trainer.sft_step(batch)
        inputs.metrics.log(step, {f"sft/{k}": v for k, v in metrics.items()}, kind="sft")
        if inputs.stop() or (cfg.max_minutes is not None and time.monotonic() - started > cfg.max_minutes * 60):
            break
    inputs.metrics.set_total(recipe.run.steps, kind="train")

"""AdamW and the learning-rate schedules (per optimizer step)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from miles_engine.trainer.config import OptimizerConfig, ScheduleConfig


def lr_factor(step: int, cfg: ScheduleConfig) -> float:
    """Multiplier of the base lr after ``step`` optimizer steps.

    Warmup rises linearly ``(step + 1) / warmup_steps``; then ``linear`` decays to
    ``min_lr_ratio`` at ``total_steps``, ``cosine`` follows half a cosine to ``min_lr_ratio``.
    """
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.kind == "constant":
        return 1.0
    total = cfg.total_steps or 1
    span = max(total - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    if cfg.kind == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_optimizer(param_groups: Iterable[dict[str, Any]], cfg: OptimizerConfig,
                    schedule: ScheduleConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    groups = [dict(g) for g in param_groups]
    for g in groups:
        g.setdefault("lr", cfg.lr)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                            weight_decay=cfg.weight_decay)

    def factor(step: int) -> float:  # a plain function: LambdaLR keeps it out of its state dict
        return lr_factor(step, schedule)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return opt, sched

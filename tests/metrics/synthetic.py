"""A synthetic run directory: what the training driver writes, without training."""

from __future__ import annotations

import math
from pathlib import Path

from miles_engine.metrics import MetricsConfig, MetricsLogger
from miles_engine.metrics import keys as K

STEPS = 20


def reward_at(step: int) -> float:
    return min(1.0, 0.1 + 0.04 * step)


def write_run(run_dir: Path, steps: int = STEPS, sft_steps: int = 5) -> None:
    cfg = MetricsConfig(tensorboard=False, progress=False)
    with MetricsLogger(run_dir, cfg) as logger:
        for s in range(1, sft_steps + 1):
            logger.log(s, {K.SFT_LOSS: 3.0 / s}, kind="sft")
        for s in range(1, steps + 1):
            logger.log(s, {
                K.REWARD_MEAN: reward_at(s), "reward/single_turn": reward_at(s) + 0.05,
                "reward/two_turn": reward_at(s) - 0.05, K.REWARD_STD: 0.2,
                K.TOOL_USE_RATE: s / steps, K.STALENESS_AVG: 0.5, K.STALENESS_MAX: 1,
                K.QUEUE_SIZE: s % 4, K.NUM_SAMPLES: 16,
                K.TIS_RATIO_MEAN: 1.0, K.TIS_RATIO_MIN: 0.8, K.TIS_RATIO_MAX: 1.3, K.TIS_CLIPPED_FRAC: 0.01,
                K.TIS_ABS_RATIO_MINUS_1: 0.02, K.TIS_LOGPROB_DIFF: 0.01,
                K.TIME_GENERATION: 1.0, K.TIME_REWARD: 0.2, K.TIME_TRAIN: 0.7, K.TIME_PUSH: 0.1, K.TIME_STEP: 1.5,
                K.TRAIN_LOSS: math.nan if s == 3 else 0.1, K.GRAD_NORM: 1.0,
            })
            if s % 5 == 0:
                logger.log(s, {K.EVAL_REWARD: reward_at(s)}, kind="eval")
    (run_dir / "config.yaml").write_text("trainer:\n  lr: 1.0e-4  # <tag>\n")

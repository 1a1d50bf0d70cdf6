"""The recipe's ``sft`` section and what a warm start is handed (the run's parts it uses)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from miles_engine.components import Section
from miles_engine.sft.dataset import SFTDatasetConfig


class SFTRunConfig(Section):
    """Supervised warm start on the environment's (noisy) demonstrations, before RL."""

    enabled: bool = True
    demos: int = Field(6000, ge=1, description="fresh demonstrations generated for the warm start")
    batch_size: int = Field(32, ge=1)
    epochs: float = Field(1.0, gt=0)
    wrong_fraction: float | None = Field(None, ge=0, le=1, description="default: the environment's own setting")
    max_minutes: float | None = Field(None, gt=0, description="stop the warm start early after this long")
    dataset: SFTDatasetConfig | None = Field(None, description="train on these chat transcripts instead of the "
                                             "environment's demonstrations (demos, wrong_fraction unused)")


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

"""The trainer: RL losses (GRPO / GSPO / PPO / REINFORCE++, clipping, TIS, OPD), SFT, and the
torch backends (one process; FSDP2 over N ranks) behind :class:`TrainerBackend`.

Importing this package does not import torch; the torch parts load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from miles_engine.trainer.config import TrainerConfig
from miles_engine.trainer.protocol import BatchError, TrainerBackend, TrainerError

_LAZY = {
    "TorchTrainer": "miles_engine.trainer.torch_trainer",
    "FSDPTrainer": "miles_engine.trainer.distributed",
    "build_trainer": "miles_engine.trainer.distributed",
    "SFTRow": "miles_engine.trainer.rows",
}

__all__ = ["BatchError", "TrainerBackend", "TrainerConfig", "TrainerError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'miles_engine.trainer' has no attribute {name!r}")

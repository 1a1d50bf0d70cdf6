"""Minimal checkpoints: trainer state (model, optimizer, schedule, counters) + RL step, written
to a temporary file and renamed, so a checkpoint on disk is always whole. The last K are kept."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from miles_engine.errors import ConfigError

KEEP_LAST = 2
_NAME = re.compile(r"^step_(\d{8})\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save(run_dir: Path, trainer: Any, step: int) -> Path:
    import torch

    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}.pt"
    tmp = root / f".{final.name}.tmp{os.getpid()}"
    with open(tmp, "wb") as fh:
        torch.save({"step": step, "trainer": trainer.state_dict()}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    for old in sorted(p for p in root.iterdir() if _NAME.match(p.name))[:-KEEP_LAST]:
        old.unlink(missing_ok=True)
    return final


def latest(run_dir: Path) -> Path | None:
    root = checkpoint_dir(run_dir)
    found = sorted(p for p in root.iterdir() if _NAME.match(p.name)) if root.is_dir() else []
    return found[-1] if found else None


def restore(run_dir: Path, trainer: Any) -> int:
    """Load the newest checkpoint into ``trainer``; return its RL step."""
    import torch

    path = latest(run_dir)
    if path is None:
        raise ConfigError(f"--resume {run_dir}: no checkpoint under {checkpoint_dir(run_dir)}")
    state = torch.load(path, map_location="cpu", weights_only=False)
    trainer.load_state_dict(state["trainer"])
    return int(state["step"])

"""``consumed.jsonl``: which groups each RL step trained on, one durable line per step.

    {"step": 3, "weight_version": 2, "groups": ["calc-00417@9", "echo-01234@10"]}

A line is appended (flushed and fsynced) before the step's checkpoint is written. On
``--resume`` the lines of steps after the restored checkpoint are removed (those updates were
lost with the crash and their groups are trained again), so the file always describes the
training the model actually holds: every group id appears at most once.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_engine.checkpoint.durable import replace_text

log = logging.getLogger(__name__)
FILE = "consumed.jsonl"


def append(run_dir: Path, step: int, weight_version: int, group_ids: Sequence[str]) -> None:
    line = json.dumps({"step": step, "weight_version": weight_version, "groups": list(group_ids)})
    with open(run_dir / FILE, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read(run_dir: Path) -> list[dict[str, Any]]:
    """Every whole line (a line torn by a crash is skipped)."""
    path = run_dir / FILE
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_after(run_dir: Path, step: int) -> int:
    """Keep the lines of steps ``<= step`` (atomically rewritten); return how many were removed."""
    path = run_dir / FILE
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [json.dumps(r) for r in read(run_dir) if int(r["step"]) <= step]
    if len(kept) == len(lines):
        return 0
    replace_text(path, "".join(k + "\n" for k in kept))
    dropped = len(lines) - len(kept)
    log.warning("resume: %d line(s) of %s after step %d removed (trained after the checkpoint; those groups "
                "are trained again)", dropped, FILE, step)
    return dropped

"""JSONL metrics: one object per line, flushed per line; a tolerant reader."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles_engine.metrics.keys import RESERVED

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
Value = float | int | str | None


def scalar(value: Any) -> Value:
    """A JSON-safe scalar: bools → int, numpy/torch scalars → float, non-finite → ``None``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if not isinstance(value, float):
        item = getattr(value, "item", None)  # numpy scalar, 0-d array or tensor
        if item is None:
            raise TypeError(f"metric value {value!r} ({type(value).__name__}) is not a number")
        value = item()
        if isinstance(value, bool | int):
            return int(value)
        value = float(value)
    return value if math.isfinite(value) else None


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Value]:
    """``{"a": {"b": 1}}`` → ``{"a/b": 1}`` with every value passed through :func:`scalar`."""
    out: dict[str, Value] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}/"))
        else:
            out[name] = scalar(value)
    return out


def make_row(step: int, time_s: float, kind: str, metrics: Mapping[str, Any]) -> dict[str, Value]:
    flat = flatten(metrics)
    clash = RESERVED & flat.keys()
    if clash:
        raise ValueError(f"metric names {sorted(clash)} are reserved for the row itself (step, time, kind)")
    return {"step": int(step), "time": round(float(time_s), 6), "kind": kind, **flat}


class JsonlSink:
    """Appends rows to ``RUN_DIR/metrics.jsonl``; each line is flushed (and fsynced on close)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _repair_tail(self.path)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held for the run

    def write(self, row: Mapping[str, Value]) -> None:
        self._fh.write(json.dumps(row, allow_nan=False, separators=(",", ":")) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()


def _repair_tail(path: Path) -> None:
    """On resume after a crash the last line may be cut short: end it so new rows stay parseable."""
    if path.exists() and path.stat().st_size:
        with open(path, "rb+") as fh:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows of ``RUN_DIR/metrics.jsonl`` (or of that file given directly), in file order.

    A truncated or garbled line (a crash mid-write) is skipped with a warning; ``null``
    stands for a non-finite value. Raises ``FileNotFoundError`` when there is no file.
    """
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS_FILE
    rows: list[dict[str, Any]] = []
    bad = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
            else:
                bad += 1
    if bad:
        log.warning("%s: skipped %d unreadable line(s) (truncated write?)", path, bad)
    return rows


def last_time(path: Path) -> float:
    """Largest ``time`` already in ``path`` (0 if none): a resumed run continues the clock."""
    try:
        return max((float(r.get("time") or 0.0) for r in read_metrics(path)), default=0.0)
    except FileNotFoundError:
        return 0.0

"""``MetricsLogger``: the one object the driver logs to; fans rows out to the sinks."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import Field, field_validator

from miles_engine.components import Section
from miles_engine.metrics.jsonl import METRICS_FILE, JsonlSink, last_time, make_row
from miles_engine.metrics.progress import ProgressDisplay
from miles_engine.metrics.trajectory_records import check_keep
from miles_engine.metrics.sinks import make_tensorboard, make_wandb

log = logging.getLogger(__name__)


class MetricsConfig(Section):
    """``metrics:`` section of a recipe."""

    jsonl: bool = Field(True, description="RUN_DIR/metrics.jsonl (what `miles report` reads)")
    tensorboard: Literal["auto"] | bool = Field(
        "auto", description="event files in RUN_DIR/tensorboard; auto: when tensorboard is installed")
    wandb: bool = Field(False, description="W&B in offline mode under RUN_DIR (upload later with `wandb sync`)")
    wandb_project: str = Field("miles", min_length=1)
    progress: bool = Field(True, description="progress bar (plain lines when stdout is not a terminal)")
    samples_per_step: int = Field(2, ge=0, description="RUN_DIR/samples.jsonl: this many trajectories of each RL "
                                  "step, best- and worst-rewarded alternately, decoded (0: off)")
    progress_every: int | None = Field(None, ge=1, description="plain mode: a line every N steps "
                                       "(default: ~20 lines per phase)")
    trajectories: str = Field("best_worst", description="RUN_DIR/trajectories.mtr: a summary of every trajectory; "
                              "the body (tokens, log-probs, conversation, commands) of: best_worst (each step's "
                              "best and worst), sample:N (N at random per step, seeded), all")

    @field_validator("trajectories")
    @classmethod
    def _trajectories(cls, value: str) -> str:
        return check_keep(value)


class MetricsLogger:
    """Log rows with :meth:`log`; call :meth:`close` (or use as a context manager) at the end.

    ``total_steps`` sizes the progress bar for ``kind="train"``; :meth:`set_total` starts
    another phase (``logger.set_total(200, kind="sft")`` before the warm start). A run
    directory that already has ``metrics.jsonl`` (``--resume``) is appended to and its
    clock continues from the last row's ``time``. Raises ``ConfigError`` at construction when
    ``tensorboard: true`` or ``wandb: true`` is set but the package is not installed.
    """

    def __init__(self, run_dir: str | os.PathLike[str], config: MetricsConfig | None = None, *,
                 total_steps: int | None = None, run_config: Mapping[str, Any] | None = None,
                 progress_stream: IO[str] | None = None, progress_plain: bool | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.config = config or MetricsConfig()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._closed = False
        self._t0 = time.monotonic() - last_time(self.run_dir / METRICS_FILE)
        self._optional: list[Any] = [s for s in (
            make_tensorboard(self.run_dir, self.config.tensorboard),
            make_wandb(self.run_dir, self.config.wandb, self.config.wandb_project, run_config)) if s is not None]
        self._jsonl = JsonlSink(self.run_dir) if self.config.jsonl else None
        self.progress = (ProgressDisplay(total_steps, every=self.config.progress_every, stream=progress_stream,
                                         plain=progress_plain) if self.config.progress else None)

    @property
    def path(self) -> Path:
        return self.run_dir / METRICS_FILE

    @property
    def sinks(self) -> list[str]:
        names = ["jsonl"] if self._jsonl else []
        return names + [type(s).__name__.removesuffix("Sink").lower() for s in self._optional]

    def log(self, step: int, metrics: Mapping[str, Any], *, kind: str = "train") -> dict[str, Any]:
        """Write one row (``step``: the step just finished, counted from 1). Nested dicts are
        flattened with ``/``; non-finite floats become ``null``. Returns the row written."""
        with self._lock:
            if self._closed:
                raise RuntimeError("MetricsLogger.log() after close()")
            row = make_row(step, time.monotonic() - self._t0, kind, metrics)
            if self._jsonl is not None:
                self._jsonl.write(row)
            values = {k: v for k, v in row.items() if k not in ("step", "time", "kind")}
            for sink in list(self._optional):
                try:
                    sink.write(step, kind, values)
                except Exception as exc:  # an optional sink must never stop training
                    log.warning("metrics sink %s failed (%s); disabled for the rest of the run",
                                type(sink).__name__, exc)
                    self._optional.remove(sink)
            if self.progress is not None:
                self.progress.update(step, kind, values)
            return row

    def set_total(self, total: int | None, *, kind: str = "train") -> None:
        """Start a progress phase: the bar follows rows of ``kind`` up to ``total`` steps."""
        if self.progress is not None:
            self.progress.set_total(total, kind=kind)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.progress is not None:
                self.progress.close()
            for sink in self._optional:
                try:
                    sink.close()
                except Exception as exc:
                    log.warning("closing metrics sink %s failed: %s", type(sink).__name__, exc)
            if self._jsonl is not None:
                self._jsonl.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

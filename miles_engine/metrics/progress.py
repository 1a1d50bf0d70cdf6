"""Progress display: a rich bar on a terminal, plain periodic lines otherwise (logs, CI)."""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Mapping
from typing import IO, Any

from miles_engine.metrics import keys as K

MA_WINDOW = 3


def _fmt_elapsed(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class ProgressDisplay:
    """Tracks rows of one kind (``train`` by default; :meth:`set_total` switches phase).

    Shows the reward's 3-step moving average, SFT loss, step time, queue size, staleness
    and samples/s, whichever the rows carry. ``plain`` (default: stdout is not a terminal)
    prints one line every ``every`` steps (default ~20 lines per phase), at the first and
    at the last step.
    """

    def __init__(self, total: int | None = None, *, kind: str = "train", every: int | None = None,
                 plain: bool | None = None, stream: IO[str] | None = None) -> None:
        self.stream = stream or sys.stdout
        self.plain = (not _isatty(self.stream)) if plain is None else plain
        self._every_setting = every
        self._progress: Any = None
        self._task: Any = None
        self.set_total(total, kind=kind)

    def set_total(self, total: int | None, *, kind: str = "train") -> None:
        """Start a new phase (e.g. SFT warm start, then RL) with its own step count."""
        self.kind, self.total = kind, total
        self.every = self._every_setting or (max(1, total // 20) if total else 10)
        self._rewards: deque[float] = deque(maxlen=MA_WINDOW)
        self._samples = 0.0
        self._t0 = time.monotonic()
        self._last_printed: int | None = None
        if not self.plain:
            self._start_rich()

    def _start_rich(self) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)
        from rich.table import Column

        if self._progress is None:
            fixed = {"table_column": Column(no_wrap=True)}  # narrow terminals wrap the stats, not these
            self._progress = Progress(TextColumn("[bold]{task.description}", **fixed), BarColumn(bar_width=20),
                                      MofNCompleteColumn(**fixed), TimeElapsedColumn(**fixed),
                                      TimeRemainingColumn(**fixed),
                                      TextColumn("{task.fields[stats]}", table_column=Column(overflow="fold")),
                                      console=Console(file=self.stream), transient=False)
            self._progress.start()
        elif self._task is not None:
            self._progress.stop_task(self._task)
        self._task = self._progress.add_task(self.kind, total=self.total, stats="")

    def stats(self, metrics: Mapping[str, Any]) -> dict[str, str]:
        """Update running state from one row; the fields to show, in order."""
        out: dict[str, str] = {}
        reward = metrics.get(K.REWARD_MEAN)
        if isinstance(reward, int | float):
            self._rewards.append(float(reward))
        if self._rewards:
            out["reward"] = f"{sum(self._rewards) / len(self._rewards):.3f}"
        for key, label, fmt in ((K.SFT_LOSS, "loss", "{:.4f}"), (K.TIME_STEP, "step", "{:.2f}s"),
                                (K.QUEUE_SIZE, "queue", "{:.0f}"), (K.STALENESS_AVG, "stale", "{:.2f}")):
            value = metrics.get(key)
            if isinstance(value, int | float):
                out[label] = fmt.format(value)
        rate = metrics.get(K.SAMPLES_PER_S)
        samples = metrics.get(K.NUM_SAMPLES)
        if isinstance(samples, int | float):
            self._samples += samples
            if not isinstance(rate, int | float):
                rate = self._samples / max(time.monotonic() - self._t0, 1e-9)
        if isinstance(rate, int | float):
            out["samples/s"] = f"{rate:.1f}"
        return out

    def update(self, step: int, kind: str, metrics: Mapping[str, Any]) -> None:
        """One logged row; ``step`` is the step just finished, counted from 1."""
        if kind != self.kind:
            return
        fields = self.stats(metrics)
        if not self.plain:
            text = "  ".join(f"{k} {v}" for k, v in fields.items())
            self._progress.update(self._task, completed=step, stats=text)
            return
        last = self.total is not None and step >= self.total
        if self._last_printed is None or step % self.every == 0 or last:
            self._last_printed = step
            total = f"/{self.total} ({100 * step / self.total:.0f}%)" if self.total else ""
            parts = [f"[{self.kind}] step {step}{total}", f"elapsed {_fmt_elapsed(time.monotonic() - self._t0)}"]
            parts += [f"{k} {v}" for k, v in fields.items()]
            print(" | ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False

"""A run's metric rows as series, moving averages and the summary numbers of the report."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from miles_engine.errors import MilesError
from miles_engine.metrics import keys as K
from miles_engine.metrics.jsonl import METRICS_FILE, read_metrics

MA_WINDOW = 3
EDGE_FRACTION = 0.2  # "first 20% vs last 20%" of the steps


class ReportError(MilesError):
    """A run directory cannot be reported on (missing, no metrics, no rows)."""


Series = tuple[list[int], list[float]]


def moving_average(steps: Sequence[int], values: Sequence[float], window: int = MA_WINDOW) -> Series:
    """Trailing mean over full windows (the first point is at ``steps[window-1]``); with fewer
    than ``window`` points, one point: the mean of all of them at the last step."""
    if not values:
        return [], []
    if len(values) < window:
        return [steps[-1]], [sum(values) / len(values)]
    return (list(steps[window - 1:]),
            [sum(values[i - window + 1:i + 1]) / window for i in range(window - 1, len(values))])


def edge_means(values: Sequence[float], fraction: float = EDGE_FRACTION) -> tuple[float, float]:
    """Mean of the first and of the last ``ceil(fraction * n)`` values."""
    n = max(1, math.ceil(fraction * len(values)))
    return sum(values[:n]) / n, sum(values[-n:]) / n


class RunData:
    """Rows grouped by kind; rows of one (kind, step) are merged, later values winning (a
    resumed run re-logs the steps after its checkpoint)."""

    def __init__(self, rows: Iterable[dict[str, Any]], run_dir: Path | None = None) -> None:
        self.run_dir = run_dir
        self.by_kind: dict[str, dict[int, dict[str, Any]]] = {}
        self.wall_time = 0.0
        self._keys: dict[str | None, set[str]] = {}
        for row in rows:
            kind = str(row.get("kind", "train"))
            try:
                step = int(row["step"])
            except (KeyError, TypeError, ValueError):
                continue
            self.by_kind.setdefault(kind, {}).setdefault(step, {}).update(row)
            t = row.get("time")
            if isinstance(t, int | float):
                self.wall_time = max(self.wall_time, float(t))

    @classmethod
    def load(cls, run_dir: str | os.PathLike[str]) -> RunData:
        path = Path(run_dir)
        if not path.exists():
            raise ReportError(f"run directory {path} does not exist")
        if not path.is_dir():
            raise ReportError(f"{path} is not a directory; pass the run directory (the one holding {METRICS_FILE})")
        if not (path / METRICS_FILE).is_file():
            raise ReportError(f"{path} has no {METRICS_FILE}; is it a run directory? "
                              "(runs write it from their first logged step)")
        data = cls(read_metrics(path), path)
        if not data.by_kind:
            raise ReportError(f"{path / METRICS_FILE} has no metric rows yet; nothing to report")
        return data

    def keys(self, kind: str | None = "train") -> set[str]:
        """Numeric metric keys in rows of ``kind`` (any kind: ``None``)."""
        if kind not in self._keys:
            kinds = self.by_kind.values() if kind is None else [self.by_kind.get(kind, {})]
            self._keys[kind] = {k for rows in kinds for row in rows.values() for k, v in row.items()
                                if k not in K.RESERVED and isinstance(v, int | float) and not isinstance(v, bool)}
        return self._keys[kind]

    def resolve(self, key: str, kind: str | None = "train") -> str | None:
        """The first spelling of ``key`` (canonical, then aliases) present among ``kind`` rows."""
        present = self.keys(kind)
        return next((k for k in K.spellings(key) if k in present), None)

    def series(self, key: str, kind: str | None = "train") -> Series:
        """(steps, values) of ``key`` (or an alias) in rows of ``kind`` (any kind: ``None``),
        sorted by step; ``null`` values are skipped."""
        name = self.resolve(key, kind)
        if name is None:
            return [], []
        merged: dict[int, float] = {}
        for k in ([kind] if kind is not None else list(self.by_kind)):
            for step, row in self.by_kind.get(k, {}).items():
                v = row.get(name)
                if isinstance(v, int | float) and not isinstance(v, bool):
                    merged[step] = float(v)
        steps = sorted(merged)
        return steps, [merged[s] for s in steps]

    def has(self, key: str, kind: str | None = "train") -> bool:
        return bool(self.series(key, kind)[0])

    def reward_kinds(self) -> list[str]:
        return K.reward_kinds(self.keys("train"))

    def summary(self) -> dict[str, float | int | None]:
        """Headline numbers (``None`` where the run has no data for them)."""
        train = self.by_kind.get("train", {})
        out: dict[str, float | int | None] = {
            "train steps": len(train),
            "last step": max(train) if train else None,
            "wall time (s)": round(self.wall_time, 1),
        }
        steps, rewards = self.series(K.REWARD_MEAN)
        if rewards:
            first, last = edge_means(rewards)
            ma = moving_average(steps, rewards)[1]
            out.update({"reward, first 20% mean": first, "reward, last 20% mean": last,
                        "reward change (last - first)": last - first,
                        "max 3-step moving avg reward": max(ma), "final 3-step moving avg reward": ma[-1]})
        for kind in self.reward_kinds():
            s, v = self.series(K.REWARD_PREFIX + kind)
            if v:
                out[f"max 3-step moving avg reward ({kind})"] = max(moving_average(s, v)[1])
        _, samples = self.series(K.NUM_SAMPLES)
        if samples:
            out["samples trained"] = int(sum(samples))
        _, times = self.series(K.TIME_STEP)
        if times:
            out["mean step time (s)"] = sum(times) / len(times)
        if "sft" in self.by_kind:
            out["sft steps"] = len(self.by_kind["sft"])
            _, loss = self.series(K.SFT_LOSS, "sft")
            if loss:
                out["sft loss, first"], out["sft loss, last"] = loss[0], loss[-1]
        _, kl = self.series(K.OPD_REVERSE_KL)
        if kl:
            first, last = edge_means(kl)
            out.update({"opd reverse KL, first 20% mean": first, "opd reverse KL, last 20% mean": last})
        _, ev = self.series(K.EVAL_REWARD, None)
        if ev:
            out["eval reward, last"] = ev[-1]
            _, low = self.series(K.EVAL_REWARD + "_ci_low", None)
            _, high = self.series(K.EVAL_REWARD + "_ci_high", None)
            if low and high:
                out["eval reward, first"] = ev[0]
                out["eval reward, last: 95% interval low"], out["eval reward, last: 95% interval high"] = low[-1], high[-1]
        return out

    def final_values(self, kind: str = "train") -> dict[str, float]:
        """Last non-null value of every numeric key of ``kind`` rows."""
        out: dict[str, float] = {}
        for step in sorted(self.by_kind.get(kind, {})):
            for k, v in self.by_kind[kind][step].items():
                if k not in K.RESERVED and isinstance(v, int | float) and not isinstance(v, bool):
                    out[k] = float(v)
        return dict(sorted(out.items()))

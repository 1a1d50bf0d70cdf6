"""A run directory as the dashboard reads it: metrics rows, trajectory records, evaluations.

Everything is read incrementally: :meth:`RunView.refresh` reads only the bytes appended since the
last call (``metrics.jsonl`` up to its last complete line, ``trajectories.mtr`` through
:class:`TrajectoryStore`), so a followed run costs what it appended, not what it holds.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_engine.errors import MilesError
from miles_engine.metrics.jsonl import METRICS_FILE
from miles_engine.metrics.trajectory_store import TRAJECTORIES_FILE, TrajectoryStore
from miles_engine.report.data import RunData

EVAL_DIR = "eval"


class NotARunError(MilesError):
    """A path given to the dashboard is not a run directory (or is gone)."""


def check_run_dir(path: Path) -> Path:
    """``path`` if it is a run directory (holds metrics.jsonl or trajectories.mtr); else one clear error."""
    if not path.exists():
        raise NotARunError(f"{path}: no such directory")
    if not path.is_dir():
        raise NotARunError(f"{path}: not a directory (pass the run directory, the one holding {METRICS_FILE})")
    if not (path / METRICS_FILE).is_file() and not (path / TRAJECTORIES_FILE).is_file():
        raise NotARunError(f"{path}: not a run directory: it has neither {METRICS_FILE} nor {TRAJECTORIES_FILE}")
    return path


def _as_int(value: Any) -> int:
    """A record's step or index (0 when a writer left it out or wrote something else)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


class NotFound(LookupError):
    """A run, step or record the dashboard does not have (a 404 page, not a stack trace)."""


class MetricsTail:
    """``metrics.jsonl`` read from where the last call stopped; unreadable lines skipped and counted."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self.bad_lines = 0
        self._offset = 0

    def refresh(self) -> int:
        """Reads the complete lines appended since the last call; returns how many rows were added."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return 0
        if size < self._offset:  # rewritten from scratch: read it again
            self.rows, self.bad_lines, self._offset = [], 0, 0
        if size == self._offset:
            return 0
        with open(self.path, "rb") as fh:
            fh.seek(self._offset)
            data = fh.read(size - self._offset)
        end = data.rfind(b"\n") + 1  # a line being written now waits for its newline
        added = 0
        for line in data[:end].splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except ValueError:
                self.bad_lines += 1
                continue
            if isinstance(row, dict) and "step" in row:
                self.rows.append(row)
                added += 1
            else:
                self.bad_lines += 1
        self._offset += end
        return added


@dataclass
class GroupRow:
    """One group of a step: its members' summaries and what the table shows about them."""

    group_id: str
    task_id: str
    kind: str
    members: list[dict[str, Any]]

    @property
    def rewards(self) -> list[float]:
        return [m["reward"] for m in self.members if isinstance(m.get("reward"), int | float)]

    @property
    def mean_reward(self) -> float | None:
        r = self.rewards
        return sum(r) / len(r) if r else None

    @property
    def reward_std(self) -> float | None:
        r = self.rewards
        if not r:
            return None
        mean = sum(r) / len(r)
        return math.sqrt(sum((x - mean) ** 2 for x in r) / len(r))

    @property
    def zero_variance(self) -> bool:
        r = self.rewards
        return len(r) > 1 and max(r) - min(r) == 0.0

    @property
    def filtered(self) -> str | None:
        return next((m["filtered"] for m in self.members if m.get("filtered")), None)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [m for m in self.members if m.get("error") or m.get("status", "ok") != "ok"]


GROUP_FILTERS = ("all", "zero_variance", "filtered", "failed", "trained")
# a record without the number sorts last either way
TRAJECTORY_SORTS = ("reward", "advantage", "tokens", "gap_max")


class RunView:
    """One run directory for the dashboard (thread-safe; the server calls it from worker threads)."""

    def __init__(self, run_dir: Path, index: int) -> None:
        self.run_dir = run_dir
        self.index = index
        self.name = run_dir.name or str(run_dir)
        self.metrics = MetricsTail(run_dir / METRICS_FILE)
        self.store = TrajectoryStore(run_dir)
        self._by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
        self._by_rid: dict[int, dict[str, Any]] = {}
        self._indexed = 0
        self._data: RunData | None = None
        self._data_rows = -1
        self._lock = threading.Lock()

    def exists(self) -> bool:
        return self.run_dir.is_dir()

    def refresh(self) -> bool:
        """Reads what was appended; True when anything was."""
        with self._lock:
            new_rows = self.metrics.refresh()
            new_records = self.store.refresh()
            for summary in self.store.summaries[self._indexed:]:
                self._by_step[_as_int(summary.get("step"))].append(summary)
                self._by_rid[int(summary["rid"])] = summary
            self._indexed = len(self.store.summaries)
            return bool(new_rows or new_records)

    @property
    def data(self) -> RunData:
        """The metrics rows as :class:`RunData` (rebuilt only when rows were added)."""
        with self._lock:
            if self._data is None or self._data_rows != len(self.metrics.rows):
                self._data = RunData(self.metrics.rows, self.run_dir)
                self._data_rows = len(self.metrics.rows)
            return self._data

    @property
    def version(self) -> tuple[int, int]:
        """Changes whenever something new was read (what the follow poll compares)."""
        return len(self.metrics.rows), self._indexed

    def steps(self) -> list[int]:
        """Steps with trajectory records, else steps with train rows."""
        with self._lock:
            if self._by_step:
                return sorted(self._by_step)
        return sorted(self.data.by_kind.get("train", {}))

    def step_records(self, step: int) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._by_step.get(step, ()))

    def groups(self, step: int, show: str = "all", kind: str | None = None) -> list[GroupRow]:
        """The step's groups (in first-recorded order), narrowed by ``show`` and task ``kind``."""
        by_group: dict[str, list[dict[str, Any]]] = {}
        for s in self.step_records(step):
            by_group.setdefault(str(s.get("group_id", "")), []).append(s)
        rows = [GroupRow(gid, str(ms[0].get("task_id", "")), str(ms[0].get("kind", "")),
                         sorted(ms, key=lambda m: _as_int(m.get("index")))) for gid, ms in by_group.items()]
        if kind:
            rows = [g for g in rows if g.kind == kind]
        keep = {"zero_variance": lambda g: g.zero_variance, "filtered": lambda g: g.filtered is not None,
                "failed": lambda g: bool(g.failed), "trained": lambda g: g.filtered is None}.get(show)
        return [g for g in rows if keep(g)] if keep else rows

    def ranked(self, step: int, sort: str, descending: bool, offset: int, limit: int) -> list[dict[str, Any]]:
        """One page of the step's trajectories ordered by ``sort`` (one of :data:`TRAJECTORY_SORTS`)."""
        rows = self.step_records(step)
        with_value = [r for r in rows if isinstance(r.get(sort), int | float)]
        with_value.sort(key=lambda r: r[sort], reverse=descending)
        return (with_value + [r for r in rows if not isinstance(r.get(sort), int | float)])[offset:offset + limit]

    def trajectory(self, rid: int) -> dict[str, Any]:
        """Summary and body of record ``rid`` (the summary alone when it was recorded without a body)."""
        if not self.exists():
            raise FileNotFoundError(self.run_dir)
        with self._lock:
            summary = self._by_rid.get(int(rid))
        if summary is None:
            raise NotFound(f"no trajectory record {rid} in {self.store.path}")
        if summary.get("has_body") is False:
            return dict(summary)
        return self.store.get(rid)

    def eval_files(self) -> dict[int, Path]:
        """``RUN_DIR/eval/step_NNNNNN.jsonl`` by step."""
        out: dict[int, Path] = {}
        folder = self.run_dir / EVAL_DIR
        if folder.is_dir():
            for p in folder.glob("step_*.jsonl"):
                try:
                    out[int(p.stem.removeprefix("step_"))] = p
                except ValueError:
                    continue
        return dict(sorted(out.items()))


def open_runs(paths: list[Path]) -> list[RunView]:
    runs = [RunView(check_run_dir(p), i) for i, p in enumerate(paths)]
    names = [r.name for r in runs]
    for r in runs:  # two runs called "run" in different folders: show the parent too
        if names.count(r.name) > 1:
            r.name = os.path.join(r.run_dir.parent.name, r.name)
    for r in runs:
        r.refresh()
    return runs

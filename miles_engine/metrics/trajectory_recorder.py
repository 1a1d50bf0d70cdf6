"""``TrajectoryRecorder``: one step's trajectories (and the groups dropped meanwhile) into
``RUN_DIR/trajectories.mtr``. The driver asks it which bodies it keeps before training (the
trainer returns its log-probs for those rows only) and writes after the step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_engine.metrics.trajectory_records import Key, PieceDecoder, body, kept_bodies, key_of, summary
from miles_engine.metrics.trajectory_store import TrajectoryWriter
from miles_engine.rollout.types import Group, Trajectory


@dataclass
class StepRecord:
    records: int
    bytes: int
    seconds: float


class TrajectoryRecorder:
    def __init__(self, run_dir: Path, keep: str, *, seed: int, decode: Callable[[list[int]], str]) -> None:
        self.keep, self.seed = keep, seed
        self.pieces = PieceDecoder(decode)
        self.writer = TrajectoryWriter(run_dir)
        self._dropped: list[tuple[list[Trajectory], str]] = []
        self._lock = threading.Lock()

    def dropped(self, trajectories: Sequence[Trajectory], reason: str) -> None:
        """The buffer's hook: trajectories that will not be trained on, and why."""
        with self._lock:
            self._dropped.append((list(trajectories), reason))

    def bodies(self, step: int, groups: Sequence[Group]) -> set[Key]:
        return kept_bodies([t for g in groups for t in g.trajectories], self.keep, seed=self.seed, step=step)

    def write_step(self, step: int, version: int, groups: Sequence[Group], keep: set[Key],
                   trainer_rows: Mapping[Key, Mapping[str, Any]],
                   fallback_advantages: Mapping[Key, float]) -> StepRecord:
        """Every trained trajectory of ``groups`` (bodies for ``keep``) and every one dropped since the
        last call; ``trainer_rows``: per trajectory, what the trainer reported (``advantage``,
        ``trainer_logprobs``); ``fallback_advantages`` where it reported none."""
        t0 = time.perf_counter()
        with self._lock:
            dropped, self._dropped = self._dropped, []
        records: list[tuple[dict[str, Any], dict[str, Any]]] = []
        for g in groups:
            for t in g.trajectories:
                k = key_of(t)
                row = trainer_rows.get(k) or {}
                adv = row.get("advantage", fallback_advantages.get(k))
                logps = row.get("trainer_logprobs")
                if logps is not None:
                    logps = [x if m else 0.0 for x, m in zip(logps, t.loss_mask)]
                kept = k in keep
                s = summary(t, step=step, version=version, advantage=adv, filtered=None, trainer_logprobs=logps,
                            has_body=kept)
                records.append((s, body(t, self.pieces(t.token_ids), logps) if kept else {}))
        for trajectories, reason in dropped:
            for t in trajectories:
                records.append((summary(t, step=step, version=version, advantage=None, filtered=reason,
                                        trainer_logprobs=None, has_body=False), {}))
        n_bytes = self.writer.append(records)
        return StepRecord(len(records), n_bytes, time.perf_counter() - t0)

    def resume_at(self, step: int) -> int:
        """``--resume`` from ``step``'s checkpoint: the records of later steps are cut (they run again)."""
        return self.writer.truncate_after_step(step)

    def close(self) -> None:
        self.writer.close()


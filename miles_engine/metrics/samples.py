"""``samples.jsonl``: what the policy actually wrote, a few trajectories per RL step.

    {"step": 12, "weight_version": 12, "task_id": "echo-01234", "group_id": "echo-01234@7",
     "index": 3, "reward": 1.0, "status": "ok", "prompt_tokens": 88, "sampled_tokens": 9,
     "completion": "<tool_call>...</tool_call><|im_end|>..."}

Per step the best- and worst-rewarded trajectories, alternately (``samples_per_step`` of them),
decoded from the first sampled token to the end (tool responses included, the prompt not):
reward curves say *that* a run drifted, these say *into what* (a collapse to plain text, a
format the parser misses, runaway lengths). Appended and flushed per step; not fsynced (a
diagnostic, not state). After ``--resume`` the steps after the checkpoint appear again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from miles_engine.rollout.types import Group, Trajectory

SAMPLES_FILE = "samples.jsonl"
MAX_CHARS = 4000  # per completion; longer ones keep their head and tail


def pick(trajectories: Sequence[Trajectory], n: int) -> list[Trajectory]:
    """Up to ``n`` trajectories: best, worst, second best, second worst, ... (unscored last)."""
    scored = sorted((t for t in trajectories if t.reward is not None), key=lambda t: -t.reward)
    order: list[Trajectory] = []
    lo, hi = 0, len(scored) - 1
    while lo <= hi and len(order) < n:
        order.append(scored[lo])
        if lo != hi and len(order) < n:
            order.append(scored[hi])
        lo, hi = lo + 1, hi - 1
    order += [t for t in trajectories if t.reward is None][: n - len(order)]
    return order


def clip_text(text: str, limit: int = MAX_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} [... {len(text) - 2 * half} chars ...] {text[-half:]}"


def sample_row(step: int, version: int, t: Trajectory, decode: Callable[[list[int]], str]) -> dict[str, Any]:
    first = next((i for i, m in enumerate(t.loss_mask) if m), len(t.token_ids))
    return {"step": step, "weight_version": version, "task_id": t.task_id, "group_id": t.group_id,
            "index": t.index, "reward": t.reward, "status": t.status, "prompt_tokens": first,
            "sampled_tokens": sum(t.loss_mask), "completion": clip_text(decode(t.token_ids[first:]))}


class SampleLog:
    """Appends :func:`sample_row` lines for each step to ``RUN_DIR/samples.jsonl``."""

    def __init__(self, run_dir: Path, per_step: int, decode: Callable[[list[int]], str]) -> None:
        self.path = Path(run_dir) / SAMPLES_FILE
        self.per_step, self.decode = per_step, decode
        self._fh: IO[str] | None = None

    def write(self, step: int, version: int, groups: Sequence[Group]) -> None:
        if self.per_step <= 0:
            return
        chosen = pick([t for g in groups for t in g.trajectories], self.per_step)
        if self._fh is None:
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held for the run
        for t in chosen:
            self._fh.write(json.dumps(sample_row(step, version, t, self.decode), ensure_ascii=False) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

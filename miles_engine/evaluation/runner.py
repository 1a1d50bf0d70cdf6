"""Run an eval task set: every attempt becomes one :class:`AttemptRecord`, scored or an error.

An attempt whose episode could not be scored (the sandbox failed, setup failed, the verifier
raised or gave no reward, the agent crashed, the eval deadline expired) is an *error*: it is
counted per kind and left out of every score, never scored 0. Records are written one JSON
line each to ``RUN_DIR/eval/step_NNNNNN.jsonl`` (atomically) and read back for comparisons.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from miles_engine.evaluation import stats
from miles_engine.evaluation.config import EvalConfig
from miles_engine.evaluation.splits import EvalTasks
from miles_engine.rollout.episode import EpisodeResult, run_episode

EVAL_DIR = "eval"


@dataclass
class AttemptRecord:
    task_id: str
    attempt: int
    reward: float | None
    passed: bool | None
    error: str | None = None
    error_kind: str | None = None  # sandbox | setup | verifier | agent | timeout | external
    weight_versions: list[int] | None = None  # the distinct versions that sampled this attempt's tokens
    turns: int = 0
    stop_reason: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _versions(result: EpisodeResult) -> list[int] | None:
    rows = (result.info.get("tito") or {}).get("trajectories") or []
    seen = {v for row in rows for v in row.get("weight_versions") or [] if isinstance(v, int)}
    return sorted(seen) if seen else None


def record_of(task_id: str, attempt: int, result: EpisodeResult, threshold: float, seconds: float) -> AttemptRecord:
    base = dict(weight_versions=_versions(result), turns=result.agent.turns, stop_reason=result.agent.stop_reason,
                seconds=round(seconds, 3))
    reward = result.reward.reward
    if reward is None:
        kind = "verifier" if result.reward_error else "setup"
        return AttemptRecord(task_id, attempt, None, None, result.reward.error or "no reward", kind, **base)
    if result.agent.stop_reason == "error":  # the harness failed (engine, session server), not the policy
        why = str(result.agent.info.get("error") or "agent error")
        return AttemptRecord(task_id, attempt, None, None, why, "agent", **base)
    return AttemptRecord(task_id, attempt, float(reward), reward >= threshold, **base)


async def run_eval(tasks: EvalTasks, make_agent: Callable[[], Any], backend: Any, cfg: EvalConfig, *,
                   reward: Any = None) -> list[AttemptRecord]:
    """``cfg.attempts`` attempts of every task, at most ``cfg.jobs`` at a time."""
    gate = asyncio.Semaphore(cfg.jobs)

    async def one(task_id: str, attempt: int) -> AttemptRecord:
        async with gate:
            t0 = time.perf_counter()
            try:
                async with asyncio.timeout(cfg.timeout_s):
                    task = tasks.source.load_task(task_id)  # a fresh task object per attempt
                    result = await run_episode(task, make_agent(), backend, reward=reward)
            except TimeoutError:
                return AttemptRecord(task_id, attempt, None, None, f"eval episode exceeded eval.timeout_s "
                                     f"({cfg.timeout_s:g}s)", "timeout", seconds=time.perf_counter() - t0)
            except Exception as exc:  # noqa: BLE001 - a sandbox that cannot start is an error, not a crash
                return AttemptRecord(task_id, attempt, None, None, _describe(exc), "sandbox",
                                     seconds=time.perf_counter() - t0)
            return record_of(task_id, attempt, result, cfg.success_threshold, time.perf_counter() - t0)

    return list(await asyncio.gather(*(one(t, a) for t in tasks.ids for a in range(cfg.attempts))))


def outcomes(records: Iterable[AttemptRecord]) -> list[stats.TaskOutcome]:
    by_task: dict[str, list[AttemptRecord]] = defaultdict(list)
    for r in records:
        by_task[r.task_id].append(r)
    return [stats.TaskOutcome(task_id, tuple(r.reward for r in rs if r.ok and r.reward is not None),
                              tuple(bool(r.passed) for r in rs if r.ok), errors=sum(not r.ok for r in rs))
            for task_id, rs in by_task.items()]


def summary_metrics(records: Sequence[AttemptRecord], cfg: EvalConfig, prefix: str = "eval/") -> dict[str, float]:
    """``eval/reward`` and ``eval/pass@k`` (each with ``_se``, ``_ci_low``, ``_ci_high``), counts
    of tasks, attempts, scored attempts and errors (per kind)."""
    out: dict[str, float] = {}
    summary = stats.summarize(outcomes(records), cfg.ks, resamples=cfg.bootstrap_resamples, seed=cfg.seed)
    for name, est in summary.items():
        out.update({f"{prefix}{k}": v for k, v in est.metrics(name).items()})
    errors = Counter(r.error_kind for r in records if not r.ok)
    out.update({f"{prefix}tasks": float(len({r.task_id for r in records})), f"{prefix}attempts": float(len(records)),
                f"{prefix}scored": float(sum(r.ok for r in records)), f"{prefix}errors": float(sum(errors.values())),
                f"{prefix}tasks_scored": float(summary["reward"].n)})
    out.update({f"{prefix}errors/{kind}": float(n) for kind, n in sorted(errors.items())})
    return out


def per_task_values(records: Iterable[AttemptRecord], metric: str = "reward") -> dict[str, float]:
    """Per-task ``reward`` (mean over scored attempts) or ``pass@1``, for paired comparisons."""
    out = {}
    for o in outcomes(records):
        if o.n:
            out[o.task_id] = o.mean_reward() if metric == "reward" else o.c / o.n
    return out


def eval_path(run_dir: Path, step: int) -> Path:
    return run_dir / EVAL_DIR / f"step_{step:06d}.jsonl"


def write_records(path: Path, records: Sequence[AttemptRecord], **common: Any) -> Path:
    """One line per attempt (``common`` keys, e.g. step and weight version, on every line), via a
    temporary file renamed into place: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in records:
            row = {**common, **r.to_dict()}
            f.write(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in row.items()}) + "\n")
    os.replace(tmp, path)
    return path


def read_records(path: Path) -> list[AttemptRecord]:
    fields = AttemptRecord.__dataclass_fields__
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [AttemptRecord(**{k: v for k, v in row.items() if k in fields}) for row in rows]

"""A synthetic run directory for the dashboard's tests, bench and screenshots, written with the real
writers (:class:`MetricsLogger`, :class:`TrajectoryWriter`, the evaluator's ``write_records``).

Deterministic for a given seed; nothing here trains. Rewards rise with the step; some groups are
zero-variance (and filtered), some episodes fail; token ``GAP_TOKEN`` of every body has a large
trainer-rollout gap and the others none.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

from miles_engine.metrics import keys as K
from miles_engine.metrics.logger import MetricsConfig, MetricsLogger
from miles_engine.metrics.trajectory_store import TrajectoryWriter

KINDS = ("single_turn", "two_turn")
GAP_TOKEN = 3  # index of the token with a large |trainer - rollout| gap in every body
GAP = 0.8
PIECES = ("Hello", " world", "<tool>", " a&b", "\n", " ls", " -la", "</tool>", " done", " ✓")


def reward_at(step: int) -> float:
    """A learning curve: rises from ~0.1 towards 0.9, with a deterministic wiggle."""
    return min(1.0, max(0.0, 0.1 + 0.8 * (1 - math.exp(-step / 15)) + 0.03 * math.sin(step * 1.7)))


def pieces_of(n: int) -> list[str]:
    return [PIECES[i % len(PIECES)] if i % 7 else f" t{i}" for i in range(n)]


def make_record(step: int, group: int, index: int, *, tokens: int, reward: float | None, advantage: float | None,
                kind: str, status: str = "ok", error: str | None = None, filtered: str | None = None,
                body: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    prompt = min(tokens // 2, 16)
    pieces = pieces_of(tokens)
    rollout = [-0.05 * (i % 20) for i in range(tokens)]
    # a small gap on every fifth token, GAP on GAP_TOKEN, none elsewhere (GAP_TOKEN + 1 among them)
    trainer = [lp + (GAP if i == GAP_TOKEN else 0.03 * (i % 11) if i % 5 == 0 else 0.0)
               for i, lp in enumerate(rollout)]
    gaps = [abs(t - r) for t, r in zip(trainer, rollout, strict=True)]
    version = max(0, step - 1)
    summary = {"step": step, "weight_version": step, "task_id": f"task-{group % 17}", "kind": kind,
               "group_id": f"s{step}-g{group}", "index": index, "reward": reward, "advantage": advantage,
               "status": status, "error": error, "filtered": filtered, "tokens": tokens, "prompt_tokens": prompt,
               "sampled_tokens": tokens - prompt, "turns": 2, "tool_calls": 1, "truncated": False,
               "versions": [version, version + 1], "gap_mean": sum(gaps) / max(1, tokens),
               "gap_max": max(gaps, default=0.0),
               "has_body": body}
    if not body:
        return summary, {}
    return summary, {
        "token_ids": [1000 + i for i in range(tokens)], "pieces": pieces,
        "loss_mask": [0 if i < prompt else 1 for i in range(tokens)], "rollout_logprobs": rollout,
        "trainer_logprobs": trainer, "weight_versions": [None if i < prompt else version + (i * 2 >= tokens)
                                                         for i in range(tokens)],
        "routed_experts": False, "reward_components": {"verifier": reward or 0.0, "format": 0.1},
        "messages": [{"role": "system", "content": "You are a careful shell agent."},
                     {"role": "user", "content": f"Task {group}: list the files <and> count them."},
                     {"role": "assistant", "content": "I will list them.",
                      "tool_calls": [{"name": "bash", "arguments": {"command": "ls -la"}}]},
                     {"role": "tool", "content": "total 2\nfile_a\nfile_b"},
                     {"role": "assistant", "content": "There are 2 files."}],
        "commands": [{"command": "ls -la", "exit_code": 0, "duration_s": 0.4, "started_s": 0.1, "truncated": False,
                      "output": "total 2\nfile_a\nfile_b"},
                     {"command": "cat missing", "exit_code": 1, "duration_s": 0.2, "started_s": 0.7,
                      "truncated": False, "output": "cat: missing: No such file or directory"}],
    }


def step_records(step: int, *, groups: int, group_size: int, tokens: int, seed: int = 0,
                 bodies: bool = True) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """One step's records: group 0 zero-variance (filtered), group 1 with a failed episode (group_size >= 3)."""
    rng = random.Random(seed * 100_003 + step)
    out = []
    for g in range(groups):
        kind = KINDS[g % len(KINDS)]
        if g == 0:
            rewards: list[float | None] = [1.0] * group_size
        else:
            rewards = [float(rng.random() < reward_at(step)) for _ in range(group_size)]
            rewards[0], rewards[1] = 1.0, 0.0  # only group 0 is zero-variance
        if g == 1:
            rewards[-1] = None
        scored = [r for r in rewards if r is not None]
        mean = sum(scored) / len(scored) if scored else 0.0
        for i, r in enumerate(rewards):
            failed = r is None
            out.append(make_record(step, g, i, tokens=tokens, reward=r, advantage=None if failed else r - mean,
                                   kind=kind, status="failed" if failed else "ok",
                                   error="sandbox exited (OOM)" if failed else None,
                                   filtered="zero_std" if g == 0 else None, body=bodies))
    return out


def step_metrics(step: int, steps: int) -> dict[str, float]:
    return {K.REWARD_MEAN: reward_at(step), "reward/single_turn": reward_at(step) + 0.05,
            "reward/two_turn": reward_at(step) - 0.05, K.REWARD_STD: 0.2,
            K.STALENESS_AVG: 0.5 + 0.1 * (step % 3), K.STALENESS_MAX: 1 + step % 2, K.QUEUE_SIZE: step % 4,
            K.TIS_CLIPPED_FRAC: 0.01 * (1 + step % 3), K.TIS_ABS_RATIO_MINUS_1: 0.02,
            K.TIS_LOGPROB_DIFF: 0.01, K.PRECISION_GAP_MEAN: 0.004 + 0.001 * math.sin(step),
            K.PRECISION_GAP_MAX: 0.05, "rollout/truncated_rate": 0.05 / step, "engine/busy_fraction": 0.8,
            "engine/output_tokens_per_s": 900.0 + 10 * step, "sandbox/exec_s_mean": 0.3,
            K.TIME_GENERATION: 1.0, K.TIME_REWARD: 0.2, K.TIME_TRAIN: 0.7, K.TIME_PUSH: 0.1, K.TIME_STEP: 1.6,
            K.NUM_SAMPLES: 16}


def eval_metrics(step: int) -> dict[str, float]:
    r = reward_at(step)
    return {K.EVAL_REWARD: r, K.EVAL_REWARD + "_se": 0.05, K.EVAL_REWARD + "_ci_low": r - 0.1,
            K.EVAL_REWARD + "_ci_high": r + 0.1, "eval/pass@1": r - 0.08, "eval/pass@1_ci_low": r - 0.2,
            "eval/pass@1_ci_high": r + 0.04, "eval/pass@1_se": 0.06, K.EVAL_WEIGHT_VERSION: step,
            K.EVAL_LAG: 0}


def write_eval_file(run_dir: Path, step: int, tasks: int = 6) -> None:
    from miles_engine.evaluation.runner import AttemptRecord, eval_path, write_records

    records = [AttemptRecord(f"eval-{t}", a, float((t + a + step) % 3 != 0), (t + a + step) % 3 != 0)
               for t in range(tasks) for a in range(2)]
    write_records(eval_path(run_dir, step), records, step=step, weight_version=step)


def append_step(run_dir: Path, step: int, *, steps: int, groups: int = 4, group_size: int = 4, tokens: int = 40,
                eval_every: int = 5, seed: int = 0) -> None:
    """One more step of a run, as the driver would write it (records first, then the metrics row)."""
    writer = TrajectoryWriter(run_dir)
    try:
        writer.append(step_records(step, groups=groups, group_size=group_size, tokens=tokens, seed=seed))
    finally:
        writer.close()
    with MetricsLogger(run_dir, MetricsConfig(tensorboard=False, progress=False)) as logger:
        logger.log(step, step_metrics(step, steps))
        if eval_every and step % eval_every == 0:
            logger.log(step, eval_metrics(step), kind="eval")
            write_eval_file(run_dir, step)


def write_run(run_dir: Path, *, steps: int = 12, groups: int = 4, group_size: int = 4, tokens: int = 40,
              eval_every: int = 5, seed: int = 0, bodies: bool = True) -> Path:
    """A finished run of ``steps`` steps (one writer and one logger for the whole run)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    writer = TrajectoryWriter(run_dir)
    try:
        with MetricsLogger(run_dir, MetricsConfig(tensorboard=False, progress=False)) as logger:
            for step in range(1, steps + 1):
                writer.append(step_records(step, groups=groups, group_size=group_size, tokens=tokens, seed=seed,
                                           bodies=bodies))
                logger.log(step, step_metrics(step, steps))
                if eval_every and step % eval_every == 0:
                    logger.log(step, eval_metrics(step), kind="eval")
                    write_eval_file(run_dir, step)
    finally:
        writer.close()
    (run_dir / "config.yaml").write_text("# synthetic run (miles_engine.testing.dashboard_run)\n")
    return run_dir


def add_huge_trajectory(run_dir: Path, step: int, tokens: int = 200_000) -> None:
    """One very long record (its own group) at ``step``."""
    writer = TrajectoryWriter(run_dir)
    try:
        writer.append([make_record(step, 999, 0, tokens=tokens, reward=0.5, advantage=0.0, kind=KINDS[0])])
    finally:
        writer.close()

"""What a run records about each trajectory (``RUN_DIR/trajectories.mtr``, see
:mod:`~miles_engine.metrics.trajectory_store`): a summary for every trajectory of every step (the
group view needs all rewards and advantages), and a body (token row, per-token log-probs, the
conversation, the sandbox's commands) for the ones ``metrics.trajectories`` keeps:

- ``best_worst`` (default): the best- and the worst-rewarded trajectory of each step;
- ``sample:N``: N trajectories per step drawn at random, seeded by the run's seed and the step;
- ``all``: every one.

Groups the buffer dropped (and failed trajectories it took out of kept groups) are recorded at the
step in progress when they were dropped, with ``filtered`` = the reason and no body.

Summary (every record)::

    step, weight_version (the policy version after the step, as in samples.jsonl), task_id,
    kind (task kind / source, "" if unknown), group_id, index, reward, advantage (what the trainer
    used; a row's mean over its sampled tokens for per-token estimators), status, error (300 chars),
    filtered (why it was not trained on; None when trained), tokens, prompt_tokens (before the first
    sampled token), sampled_tokens, turns, tool_calls, truncated, versions ([min, max] of the sampled
    tokens' weight versions or None), gap_mean, gap_max (|trainer - rollout| log-prob over the
    sampled tokens, when the trainer's exist), has_body, failure (buffer.partial_failure's reason for
    a failed attempt kept with reward 0, else None)

Body (``has_body``; else ``{}``)::

    token_ids, pieces (each token decoded alone), loss_mask, rollout_logprobs, trainer_logprobs
    (0.0 off the loss mask; None when the trainer computed none), weight_versions, routed_experts
    (bool: R3 routes recorded), reward_components, messages ([{role, content, tool_calls?, ...}]),
    commands ([{command, exit_code, duration_s, started_s, truncated, timed_out, phase, output}])

Floats are finite or null.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from miles_engine.metrics.samples import clip_text, pick
from miles_engine.rollout.types import Trajectory

Key = tuple[str, int]  # (group_id, index): a trajectory's identity inside a run
ERROR_CHARS = 300
_SAMPLE = re.compile(r"sample:([1-9][0-9]*)")
KEEP_FORMS = "'best_worst', 'all' or 'sample:N' (N >= 1)"


def check_keep(value: str) -> str:
    """``metrics.trajectories``: the value, or ValueError naming the allowed forms."""
    if value in ("best_worst", "all") or _SAMPLE.fullmatch(value):
        return value
    raise ValueError(f"must be {KEEP_FORMS}")  # pydantic's error names the key and the value


def key_of(t: Trajectory) -> Key:
    return (t.group_id, int(t.index))


def kept_bodies(trajectories: Sequence[Trajectory], keep: str, *, seed: int, step: int) -> set[Key]:
    """The trajectories of one step whose body is recorded."""
    if keep == "all":
        return {key_of(t) for t in trajectories}
    if keep == "best_worst":
        return {key_of(t) for t in pick(trajectories, 2)}
    n = int(keep.split(":", 1)[1])
    keys = sorted(key_of(t) for t in trajectories)
    rng = random.Random(f"{seed}:{step}")  # a string seed hashes the same in every process
    return set(rng.sample(keys, min(n, len(keys))))


def finite(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def finite_list(xs: Iterable[Any] | None) -> list[float | None] | None:
    if xs is None:
        return None
    out = [float(x) for x in xs]
    if math.isfinite(sum(out)):  # a finite sum means every term is finite (the usual case)
        return out
    return [x if math.isfinite(x) else None for x in out]


def logprob_gap(t: Trajectory, trainer_logprobs: Sequence[float] | None) -> tuple[float | None, float | None]:
    """Mean and max |trainer - rollout| log-prob over the sampled tokens."""
    if trainer_logprobs is None:
        return None, None
    gaps = [abs(a - b) for a, b, m in zip(trainer_logprobs, t.rollout_logprobs, t.loss_mask) if m]
    gaps = [g for g in gaps if math.isfinite(g)]
    return (sum(gaps) / len(gaps), max(gaps)) if gaps else (None, None)


def summary(t: Trajectory, *, step: int, version: int, advantage: float | None, filtered: str | None,
            trainer_logprobs: Sequence[float] | None, has_body: bool) -> dict[str, Any]:
    first = next((i for i, m in enumerate(t.loss_mask) if m), len(t.token_ids))
    versions = t.sampled_versions
    gap_mean, gap_max = logprob_gap(t, trainer_logprobs)
    metrics = t.metrics or {}
    return {
        "step": int(step), "weight_version": int(version), "task_id": t.task_id, "kind": t.tags.get("kind", ""),
        "group_id": t.group_id, "index": int(t.index), "reward": finite(t.reward), "advantage": finite(advantage),
        "status": t.status, "error": t.error[:ERROR_CHARS] if t.error else None, "filtered": filtered,
        "tokens": len(t.token_ids), "prompt_tokens": first, "sampled_tokens": t.num_sampled,
        "turns": int(metrics.get("turns", 0)), "tool_calls": int(metrics.get("tool_calls", 0)),
        "truncated": bool(metrics.get("truncated", 0.0)),
        "versions": [min(versions), max(versions)] if versions else None,
        "gap_mean": finite(gap_mean), "gap_max": finite(gap_max), "has_body": has_body,
        "failure": t.tags.get("failure"),  # a failed attempt kept with reward 0 (buffer.partial_failure)
    }


def _command(c: Mapping[str, Any]) -> dict[str, Any]:
    return {"command": str(c.get("command", "")), "exit_code": c.get("exit_code"),
            "duration_s": finite(c.get("duration_s")) or 0.0, "started_s": finite(c.get("started_s")),
            "truncated": bool(c.get("truncated", False)), "timed_out": bool(c.get("timed_out", False)),
            "phase": c.get("phase"), "output": clip_text(str(c.get("output", "")))}


def _tool_call(call: Any) -> Any:
    """OpenAI's shape (``{id, type, function: {name, arguments}}``) whichever side recorded the call
    (the TITO row keeps ``{id, name, arguments}``)."""
    if not isinstance(call, dict) or "function" in call or "name" not in call:
        return call
    args = call.get("arguments")
    return {"id": call.get("id"), "type": "function",
            "function": {"name": call["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def _message(m: Mapping[str, Any]) -> dict[str, Any]:
    if not m.get("tool_calls"):
        return dict(m)
    return {**m, "tool_calls": [_tool_call(c) for c in m["tool_calls"]]}


def body(t: Trajectory, pieces: list[str], trainer_logprobs: Sequence[float] | None) -> dict[str, Any]:
    transcript = getattr(t, "transcript", None) or {}  # absent on trajectories pickled before the field
    return {
        "token_ids": list(t.token_ids), "pieces": pieces, "loss_mask": list(t.loss_mask),
        "rollout_logprobs": finite_list(t.rollout_logprobs), "trainer_logprobs": finite_list(trainer_logprobs),
        "weight_versions": list(t.weight_versions), "routed_experts": t.routed_experts is not None,
        "reward_components": {k: finite(v) for k, v in t.reward_components.items()},
        "messages": [_message(m) for m in transcript.get("messages") or []],
        "commands": [_command(c) for c in transcript.get("commands") or []],
    }


class PieceDecoder:
    """Each token id decoded alone, memoised (a run's vocabulary repeats across steps)."""

    def __init__(self, decode: Callable[[list[int]], str], limit: int = 1 << 18) -> None:
        self.decode, self.limit = decode, limit
        self._cache: dict[int, str] = {}

    def __call__(self, ids: Sequence[int]) -> list[str]:
        out = []
        for i in ids:
            piece = self._cache.get(i)
            if piece is None:
                piece = self.decode([i])
                if len(self._cache) < self.limit:
                    self._cache[i] = piece
            out.append(piece)
        return out

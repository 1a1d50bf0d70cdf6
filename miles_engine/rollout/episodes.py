"""One RL attempt: a sandboxed episode driven through the TITO session server → a Trajectory.

The agent talks to the session server over HTTP exactly as an external harness would; the
trajectory is the row the server owns (prompt + sampled ids + environment ids, with the
engine's per-token log-probs and weight versions), scored by the task's own verifier.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from miles_engine.agents.protocol import Agent
from miles_engine.rewards.protocol import RewardFunction
from miles_engine.rollout.episode import EpisodeResult, run_episode
from miles_engine.rollout.types import Trajectory
from miles_engine.sandbox.protocol import SandboxBackend


log = logging.getLogger(__name__)


def _empty(task_id: str, error: str, status: str = "failed") -> Trajectory:
    return Trajectory([], [], [], [], reward=None, status=status, error=error, task_id=task_id)  # type: ignore[arg-type]


def task_tags(task: Any) -> dict[str, str]:
    """``kind`` (the task's own, else the task set it came from: ``reward/<kind>`` per step tells a
    mixture's sources apart) and ``difficulty``."""
    meta = getattr(task, "metadata", {}) or {}
    kind = meta.get("kind", meta.get("source"))
    tags = {"kind": str(kind)} if kind is not None else {}
    if "difficulty" in meta:
        tags["difficulty"] = str(meta["difficulty"])
    return tags


def _message(m: Any) -> dict[str, Any]:
    content = m.get("content")
    out: dict[str, Any] = {"role": str(m.get("role", "")),
                           "content": content if isinstance(content, str) else json.dumps(content, default=str)
                           if content is not None else ""}
    for key in ("tool_calls", "tool_call_id", "name", "reasoning_content"):
        if m.get(key):
            out[key] = json.loads(json.dumps(m[key], default=str))
    return out


def episode_transcript(result: EpisodeResult, row: dict[str, Any] | None = None) -> dict[str, Any]:
    """The conversation as the agent saw it — the TITO row's own messages (the requests' and the
    generated ones along the trained row, whatever the harness), else the agent's message list
    when it kept one in the episode context, else the context's transcript — and the sandbox's
    commands."""
    messages = (row or {}).get("messages") or result.info.get("messages") or result.transcript
    return {"messages": [_message(m) for m in messages if isinstance(m, dict)],
            "commands": list(result.info.get("commands") or [])}


def to_trajectory(task: Any, result: EpisodeResult) -> Trajectory:
    """The episode's (last kept) TITO trajectory with the verifier's reward attached."""
    report = result.info.get("tito") or {}
    rows = report.get("trajectories") or []
    if not rows:
        why = report.get("error") or result.agent.info.get("error") or result.reward.error or "no trajectory recorded"
        empty = _empty(task.id, f"episode of task '{task.id}' produced no trajectory: {why}")
        empty.transcript = episode_transcript(result)
        return empty
    row = rows[-1]
    calls = sum(1 for m in result.transcript if m.get("role") == "assistant" and m.get("tool_calls"))
    status = "ok"
    if result.reward.reward is None:
        status = "reward_error" if result.reward_error else "failed"
    elif result.agent.stop_reason == "timeout":
        status = "timeout"
    traj = Trajectory(
        token_ids=list(row["token_ids"]),
        loss_mask=list(row["loss_mask"]),
        rollout_logprobs=[float(x) for x in row["rollout_logprobs"]],
        weight_versions=list(row["weight_versions"]),
        reward=result.reward.reward,
        reward_components=dict(result.reward.components),
        status=status,  # type: ignore[arg-type]
        error=result.reward.error,
        task_id=task.id,
        routed_experts=row.get("routed_experts"),
        tags=task_tags(task),
        transcript=episode_transcript(result, row),
        metrics={"turns": float(result.agent.turns), "tool_calls": float(calls), "tool_use": float(calls > 0),
                 "episode_s": sum(result.timings.values()), "generation_s": result.timings.get("agent_s", 0.0),
                 "reward_s": result.timings.get("verify_s", 0.0)},
    )
    turns = row.get("turns") or []
    traj.metrics["truncated"] = float(any(t.get("finish_reason") == "length" for t in turns))
    mismatch = row.get("tito_session_mismatch") or {}
    if isinstance(mismatch, dict) and "bug" in mismatch:
        traj.metrics["tito_mismatch_bug"] = float(bool(mismatch["bug"]))
        for kind, n in (mismatch.get("counts") or {}).items():  # by type, and the bug flag per wire format
            traj.metrics[f"tito_mismatch_type/{kind}"] = float(n > 0)
        if row.get("wire"):
            traj.metrics[f"tito_mismatch_wire/{row['wire']}"] = float(bool(mismatch["bug"]))
        if mismatch["bug"]:
            log.warning("TITO row of task %s differs from the canonical render outside assistant text: %s",
                        task.id, json.dumps({"details": mismatch.get("details"), "first": mismatch.get("first_difference")})[:3000])
    return traj


class EpisodeTrajectories:
    """``run_trajectory(task_ref, attempt) -> Trajectory`` for the scheduler: each attempt loads
    a fresh task object, so the attempts of a group never share task state."""

    def __init__(self, backend: SandboxBackend, make_agent: Callable[[], Agent], source: Any,
                 reward: RewardFunction | None = None,
                 after: Callable[[Trajectory], Awaitable[None]] | None = None) -> None:
        self.backend = backend
        self.after = after  # post-episode step on an ok trajectory (e.g. teacher scoring)
        self.reward = reward  # the recipe's reward stack; None: the task's own verifier
        self.make_agent = make_agent
        self.source = source
        self._seen_errors: set[str] = set()

    async def __call__(self, ref: Any, attempt: int) -> Trajectory:
        task = self.source.load_task(ref.id) if hasattr(ref, "id") and not hasattr(ref, "verify") else ref
        result = await run_episode(task, self.make_agent(), self.backend, reward=self.reward)
        traj = to_trajectory(task, result)
        traj.index = attempt
        return await finish_trajectory(traj, task.id, self.after, self._seen_errors)


async def finish_trajectory(traj: Trajectory, task_id: str, after: Any, seen_errors: set[str]) -> Trajectory:
    """The post-episode step on an ok trajectory; a failed one's error logged (each distinct error once)."""
    if after is not None and traj.status == "ok":
        await after(traj)
    if traj.status != "ok" and traj.error:
        kind = traj.error.split(":", 2)[-1].strip()[:200]
        if kind not in seen_errors and len(seen_errors) < 100:
            seen_errors.add(kind)
            log.warning("episode of task %s ended %s: %s", task_id, traj.status, traj.error[:1000])
    return traj

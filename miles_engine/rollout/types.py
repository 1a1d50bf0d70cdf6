"""The currency between rollout and training: trajectories and groups.

A :class:`Trajectory` is one exact token row as sampled (prompt ids + sampled ids +
environment ids) with per-token rollout log-probs, loss mask and weight versions. A
:class:`Group` is the n trajectories of one task; the trainer only ever sees whole groups.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any, Literal

# reward_error: the episode ran but its verifier gave no usable reward (see rewards.config.RewardConfig)
TrajectoryStatus = Literal["ok", "failed", "timeout", "aborted", "reward_error"]


@dataclass
class Trajectory:
    token_ids: list[int]
    loss_mask: list[int]  # 1 on sampled tokens only
    rollout_logprobs: list[float]  # 0.0 where loss_mask is 0
    weight_versions: list[int | None]  # None where loss_mask is 0 (or the engine did not report)
    reward: float | None = None
    reward_components: dict[str, float] = field(default_factory=dict)
    status: TrajectoryStatus = "ok"
    error: str | None = None
    task_id: str = ""
    group_id: str = ""
    index: int = 0  # position inside its group
    routed_experts: list[list[list[int]]] | None = None  # [tokens, moe_layers, top_k] on sampled tokens
    teacher_logprobs: list[float] | None = None  # per token, for on-policy distillation
    # OPD top-K: per token, the candidate ids fixed at scoring time ([] off the sampled tokens)
    # and the teacher's log-probs of them (miles_engine.teachers.candidates)
    teacher_candidate_ids: list[list[int]] | None = None
    teacher_candidate_logprobs: list[list[float]] | None = None
    tags: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. turns, tool_calls, tool_use
    # what the episode saw, for the run's trajectory record only (never enters the trainer's tensors):
    # {"messages": the conversation as the agent saw it, "commands": the sandbox's commands}
    transcript: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "rollout_logprobs", "weight_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"trajectory {self.task_id}#{self.index}: {name} has "
                                 f"{len(getattr(self, name))} entries for {n} tokens")

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)

    @property
    def sampled_versions(self) -> list[int]:
        return [v for v, m in zip(self.weight_versions, self.loss_mask) if m and v is not None]


@dataclass
class Group:
    group_id: str
    task_id: str
    trajectories: list[Trajectory]
    submitted_version: int  # the policy version when the group was submitted
    finished_version: int | None = None  # the policy version when its last trajectory finished
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def rewards(self) -> list[float | None]:
        return [t.reward for t in self.trajectories]

    @property
    def num_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.trajectories)


def without_transcripts(groups: list[Group] | tuple[Group, ...]) -> list[Group]:
    """Shallow copies of ``groups`` without the trajectories' transcripts: what trainer ranks in other
    processes are sent (the transcript is for the run's record, not the trainer)."""
    out = []
    for g in groups:
        trajectories = []
        for t in g.trajectories:
            if getattr(t, "transcript", None) is not None:
                t = copy.copy(t)
                t.transcript = None
            trajectories.append(t)
        out.append(replace(g, trajectories=trajectories))
    return out

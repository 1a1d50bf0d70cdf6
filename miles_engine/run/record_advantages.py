"""The trainer's per-row advantage, computed in the driver for the run's trajectory record where the
trainer did not report it (ranks in other processes report rank 0's rows, the Megatron ranks none)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_engine.metrics.trajectory_records import Key, key_of
from miles_engine.rollout.types import Group


def driver_advantages(groups: Sequence[Group], algorithm: Any, task_reward: bool = True) -> dict[Key, float]:
    """With the trainer's own function: GRPO / GSPO without whitening or OPD terms; else none."""
    if algorithm.advantage_estimator not in ("grpo", "gspo") or algorithm.normalize_advantages or not task_reward:
        return {}
    import torch

    from miles_engine.trainer.advantages import grpo_advantages

    trajs = [(gi, t) for gi, g in enumerate(groups) for t in g.trajectories if t.reward is not None]
    if not trajs:
        return {}
    rewards = torch.tensor([float(t.reward) for _, t in trajs], dtype=torch.float32)
    index = torch.tensor([gi for gi, _ in trajs], dtype=torch.long)
    try:
        adv = grpo_advantages(rewards, index, std_normalization=algorithm.grpo_std_normalization,
                              eps=algorithm.std_eps)
    except ValueError:
        return {}
    return {key_of(t): float(a) for (_, t), a in zip(trajs, adv.tolist())}

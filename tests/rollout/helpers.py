"""Builders for trajectories and groups with scripted token versions, and a bounded runner."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from miles_engine.rollout.types import Group, Trajectory

T = TypeVar("T")


def run(coro: Awaitable[T], timeout: float = 20.0) -> T:
    """asyncio.run with a hard bound."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def traj(versions: Sequence[int | None] = (0,), *, reward: float | None = 1.0, status: str = "ok",
         prompt: int = 2, env: int = 0, tokens: int | None = None) -> Trajectory:
    """``prompt`` prompt tokens, then one sampled token per entry of ``versions``, then ``env``
    environment tokens. ``tokens`` overrides the sampled count (all unversioned)."""
    sampled = list(versions) if tokens is None else [None] * tokens
    n = prompt + len(sampled) + env
    mask = [0] * prompt + [1] * len(sampled) + [0] * env
    vers: list[int | None] = [None] * prompt + sampled + [None] * env
    return Trajectory(list(range(n)), mask, [-0.5 * m for m in mask], vers, reward=reward,
                      status=status)  # type: ignore[arg-type]


def group(trajs: Sequence[Trajectory], *, gid: str = "g", finished: int | None = None, submitted: int = 0) -> Group:
    for i, t in enumerate(trajs):
        t.group_id, t.index = gid, i
    return Group(gid, gid.split("@")[0], list(trajs), submitted_version=submitted, finished_version=finished)


def versions_at(times: Sequence[float], pushes: Sequence[float]) -> list[int]:
    """The weight version in force at each time, given the times at which pushes landed."""
    return [sum(1 for p in pushes if p <= t) for t in times]

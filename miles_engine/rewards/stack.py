"""A weighted reward stack: ``reward = Σ weight_i · reward_i`` over the recipe's components.

Components are scored one after another in the episode's sandbox (they may run commands there,
so they do not race). Every term is logged in ``RewardResult.components`` under its label, and a
term's own sub-components under ``label/name``. The first term that cannot score (returns
``reward=None``, raises, times out, returns something that is not a :class:`RewardResult`) makes
the whole result ``RewardResult(reward=None, error=...)`` naming that term; the terms scored so
far stay in ``components``. Nothing here raises for a bad episode.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_engine.environments.protocol import EpisodeContext, RewardResult
from miles_engine.errors import ConfigError
from miles_engine.rewards.config import RewardComponentRef, RewardConfig
from miles_engine.rewards.protocol import describe_error

if TYPE_CHECKING:
    from miles_engine.hub import Hub


@dataclass
class StackEntry:
    label: str
    weight: float
    scorer: Any  # follows RewardFunction
    timeout_s: float | None = None


async def score_one(scorer: Any, episode: EpisodeContext, *, timeout_s: float | None = None) -> RewardResult:
    """One component's verdict, with every way it can misbehave turned into a failed result."""
    try:
        async with asyncio.timeout(timeout_s):
            result = await scorer.score(episode)
    except TimeoutError:
        return RewardResult.failed(f"timed out after {timeout_s:g}s")
    except Exception as exc:  # noqa: BLE001 - a broken verifier is a failed sample, never a crashed batch
        return RewardResult.failed(f"raised {describe_error(exc)}")
    if not isinstance(result, RewardResult):
        return RewardResult.failed(f"returned {type(result).__name__}, not a RewardResult")
    if result.reward is None and not result.error:
        return RewardResult.failed("returned no reward and no error", **result.info)
    return result


class RewardStack:
    """Follows :class:`~miles_engine.rewards.protocol.RewardFunction`."""

    def __init__(self, entries: Sequence[StackEntry]) -> None:
        if not entries:
            raise ConfigError("a reward stack needs at least one component")
        self.entries = list(entries)
        self.deterministic = all(getattr(e.scorer, "deterministic", False) for e in self.entries)

    async def score(self, episode: EpisodeContext) -> RewardResult:
        total = 0.0
        components: dict[str, float] = {}
        info: dict[str, Any] = {}
        for entry in self.entries:
            result = await score_one(entry.scorer, episode, timeout_s=entry.timeout_s)
            if result.info:
                info[entry.label] = result.info
            if result.reward is None:
                return RewardResult(reward=None, components=components, info={**info, "failed_component": entry.label},
                                    error=f"reward component '{entry.label}' failed: {result.error}")
            components[entry.label] = result.reward
            for name, value in result.components.items():
                components[f"{entry.label}/{name}"] = value
            total += entry.weight * result.reward
        if not math.isfinite(total):
            return RewardResult(reward=None, components=components, info=info,
                                error=f"the weighted sum of the reward components is {total}")
        return RewardResult(reward=total, components=components, info=info)

    async def aclose(self) -> None:
        for entry in self.entries:
            close = getattr(entry.scorer, "aclose", None)
            if close is not None:
                await close()


def build_entry(hub: Hub, ref: RewardComponentRef, *, where: str) -> StackEntry:
    scorer = hub.create("reward", ref.name, ref.options, where=f"{where}.options")
    if not callable(getattr(scorer, "score", None)):
        raise ConfigError(f"{where}: reward '{ref.name}' built a {type(scorer).__name__}, which has no "
                          f"`async score(episode)` method")
    return StackEntry(ref.key, ref.weight, scorer, ref.timeout_s)


def build_reward_stack(hub: Hub, config: RewardConfig) -> RewardStack | None:
    """The recipe's stack, or ``None`` when it keeps the environment's own verifier alone."""
    if config.components is None:
        return None
    return RewardStack([build_entry(hub, ref, where=f"reward.components.{i}")
                        for i, ref in enumerate(config.components)])

"""The parts every episode is made of, built from a recipe's references through the hub the
program built: the environment source, the sandbox backend, the reward stack and the agent.

One set of builders for every program that runs episodes (``miles train``'s composition root, a
Ray episode-runner actor, ``miles eval``); each part is closed by the exit stack it is built on,
in reverse order, so nothing is left open when a later part fails to build.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

from miles_engine.environments.capabilities import close_environment
from miles_engine.rewards.stack import build_reward_stack

if TYPE_CHECKING:
    from miles_engine.agents.protocol import Agent
    from miles_engine.environments.protocol import EnvironmentSource
    from miles_engine.hub import Hub
    from miles_engine.rewards.config import RewardConfig
    from miles_engine.rewards.stack import RewardStack
    from miles_engine.sandbox.protocol import SandboxBackend


def open_environment(hub: Hub, ref: Any, stack: AsyncExitStack, *, key: str = "environment") -> EnvironmentSource:
    """``ref`` (a ``ComponentRef``) built; ``key`` is its recipe key, for errors."""
    source = hub.create("environment", ref.name, ref.options, where=f"{key}.options")
    stack.push_async_callback(close_environment, source)
    return source


def open_sandboxes(hub: Hub, ref: Any, stack: AsyncExitStack) -> SandboxBackend:
    """The recipe's ``sandbox`` section (a ``SandboxRef``) built."""
    backend = hub.create("sandbox", ref.backend, ref.options, where="sandbox.options")
    stack.push_async_callback(backend.aclose)
    return backend


def open_reward(hub: Hub, config: RewardConfig, stack: AsyncExitStack) -> RewardStack | None:
    """The recipe's reward stack, or ``None`` when the environment's own verifier scores alone."""
    reward = build_reward_stack(hub, config)
    if reward is not None:
        stack.push_async_callback(reward.aclose)
    return reward


def agent_factory(hub: Hub, ref: Any, *, server_url: str | None = None,
                  overrides: Mapping[str, Any] | None = None) -> Callable[[], Agent]:
    """A fresh agent per episode (``ref``: the recipe's ``agent`` section), pointed at ``server_url``
    (the session server it drives) when given; ``overrides`` win over its options."""
    options = {**ref.options, **(overrides or {}), **({"server_url": server_url} if server_url else {})}
    return lambda: hub.create("agent", ref.name, options, where="agent.options")

"""The hook specifications of the ``miles`` plugin system: the whole plugin surface.

A plugin is a module (or object) with functions decorated by
``from miles_engine import hookimpl``, exposed through an entry point in group ``miles``::

    [project.entry-points.miles]
    my_env = "my_package.plugin"

Collection hooks (``miles_register_*``) return lists of registrations; the hub merges them
into one registry per kind and refuses duplicate names. Hooks register *factories*; the
rollout hot path never goes through pluggy. An implementation may accept a subset of a
spec's arguments, so specs can grow without breaking plugins. A hook implementation whose
name matches no spec below is an error at load time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_engine import hookspec

if TYPE_CHECKING:
    from miles_engine.components import Component, RecipeFile


@hookspec
def miles_register_environments() -> list[Component]:
    """Register environment sources (task sources such as Harbor directories).

    Each factory is called with its validated options and returns an object that follows
    :class:`miles_engine.environments.protocol.EnvironmentSource`.

    :return: a list of :class:`~miles_engine.components.Component`.
    """


@hookspec
def miles_register_sandboxes() -> list[Component]:
    """Register sandbox backends.

    Each factory returns an object following
    :class:`miles_engine.sandbox.protocol.SandboxBackend`; it must declare its
    capabilities truthfully so tasks it cannot isolate are refused.

    :return: a list of :class:`~miles_engine.components.Component`.
    """


@hookspec
def miles_register_rewards() -> list[Component]:
    """Register reward verifiers that score a finished episode.

    Each factory returns an object with ``async score(episode) -> RewardResult``.

    :return: a list of :class:`~miles_engine.components.Component`.
    """


@hookspec
def miles_register_teachers() -> list[Component]:
    """Register on-policy distillation teachers (per-token log-prob scorers).

    :return: a list of :class:`~miles_engine.components.Component`.
    """


@hookspec
def miles_register_agents() -> list[Component]:
    """Register agents/harnesses that drive a task's tools for up to ``max_turns``.

    Each factory returns an object following :class:`miles_engine.agents.protocol.Agent`.

    :return: a list of :class:`~miles_engine.components.Component`.
    """


@hookspec
def miles_register_chat_families() -> list[Component]:
    """Register chat families (template, stop tokens, boundary merge, parsers).

    :return: a list of :class:`~miles_engine.components.Component`.
    """


@hookspec
def miles_register_engines() -> list[Component]:
    """Register rollout-engine kinds, named by ``engines[].kind`` in a recipe.

    Each factory is called with the kind's validated options and returns an object following
    :class:`miles_engine.engines.fleet.kinds.EngineKind`: ``in_process`` and ``transports``
    (which weight transports reach its engines, checked against ``weights.transport`` at load)
    and ``async start(group, name, ctx, stack)`` returning the group's
    :class:`~miles_engine.engines.protocol.RolloutEngine` objects (teardown registered on ``stack``).
    The built-ins are ``embedded``, ``server``, ``sglang`` and ``external``; a vLLM adapter, say,
    registers the same way.

    :return: a list of :class:`~miles_engine.components.Component`.
    """


@hookspec
def miles_register_recipes() -> list[RecipeFile]:
    """Register packaged recipe YAML files shown by ``miles recipes ls``.

    :return: a list of :class:`~miles_engine.components.RecipeFile`.
    """

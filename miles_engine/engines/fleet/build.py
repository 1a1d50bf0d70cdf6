"""Start the recipe's engine groups and put them behind one router; check at load that the
weight transport can reach every group."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

from miles_engine.engines.fleet.config import EngineGroupConfig, FleetConfig
from miles_engine.engines.fleet.kinds import EngineKind, FleetContext
from miles_engine.errors import ConfigError

if TYPE_CHECKING:
    from miles_engine.engines.router import Router
    from miles_engine.hub import Hub

TRANSPORTS = ("colocated", "broadcast", "disk_delta")


def create_kinds(hub: Hub, groups: Sequence[EngineGroupConfig]) -> list[EngineKind]:
    return [hub.create("engine", g.kind, g.options, where=f"engines.{i}.options") for i, g in enumerate(groups)]


def group_names(groups: Sequence[EngineGroupConfig]) -> list[str]:
    counts = Counter(g.name or g.kind for g in groups)
    seen: Counter[str] = Counter()
    names = []
    for g in groups:
        base = g.name or g.kind
        names.append(base if counts[base] == 1 else f"{base}{seen[base]}")
        seen[base] += 1
    if len(set(names)) != len(names):
        raise ConfigError(f"engines: group names must be unique, got {names}")
    return names


def check_transport(transport: str, groups: Sequence[EngineGroupConfig], kinds: Sequence[EngineKind]) -> None:
    """One error line naming both keys and the allowed values when the transport cannot reach a group."""
    for i, (group, kind) in enumerate(zip(groups, kinds)):
        allowed = tuple(kind.transports)
        if transport not in allowed:
            where = "in the driver process" if kind.in_process else "in other processes"
            raise ConfigError(f"weights.transport={transport!r} cannot reach engines.{i}.kind={group.kind!r} "
                              f"(its engines run {where}); with engines.{i}.kind={group.kind!r} use "
                              f"weights.transport in {list(allowed)}, or pick an engines.{i}.kind that takes "
                              f"{transport!r}")


async def start_fleet(groups: Sequence[EngineGroupConfig], kinds: Sequence[EngineKind], ctx: FleetContext,
                      stack: AsyncExitStack, options: FleetConfig | None = None) -> Router:
    """Every group's engines, started concurrently, behind one started router (torn down by ``stack``)."""
    from miles_engine.engines.router import Router

    options = options or FleetConfig()
    ctx.state_dir.mkdir(parents=True, exist_ok=True)
    names = group_names(groups)
    started = await asyncio.gather(*(kind.start(g, name, ctx, stack) for g, kind, name in zip(groups, kinds, names)))
    engines: dict[str, Any] = {}
    for group_engines in started:
        for engine in group_engines:
            engines[str(getattr(engine, "name", f"engine{len(engines)}"))] = engine
    router = Router(engines, health_interval_s=options.health_interval_s, fail_threshold=options.fail_threshold,
                    readmit_after=options.readmit_after, restore=ctx.restore)
    await router.start()
    stack.push_async_callback(router.stop_health_checks)
    return router

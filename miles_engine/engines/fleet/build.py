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


def check_on_update(mode: str, groups: Sequence[EngineGroupConfig], kinds: Sequence[EngineKind]) -> None:
    """``rollout.on_update`` must be a pause mode every group's engines can honour (a kind lists the
    ones it cannot in ``pause_modes_refused``: mode -> why)."""
    for i, (group, kind) in enumerate(zip(groups, kinds)):
        why = dict(getattr(kind, "pause_modes_refused", {}) or {}).get(mode)
        if why:
            raise ConfigError(f"rollout.on_update={mode!r} cannot be honoured by engines.{i}.kind={group.kind!r}: "
                              f"{why}")


def check_precision(weight_format: str, kv_cache: str, groups: Sequence[EngineGroupConfig],
                    kinds: Sequence[EngineKind]) -> None:
    """Every group's engines must hold the precision contract's rollout stage (a kind says why not
    in ``precision_refusal``; a kind without one receives full precision only)."""
    if weight_format == "full" and kv_cache == "full":
        return
    for i, (group, kind) in enumerate(zip(groups, kinds)):
        refusal = getattr(kind, "precision_refusal", None)
        why = refusal(weight_format, kv_cache, group) if refusal is not None else (
            f"precision.rollout={weight_format!r}, precision.kv_cache={kv_cache!r}: its engines do not receive the "
            f"precision contract (full precision only)")
        if why:
            raise ConfigError(f"engines.{i}.kind={group.kind!r}: {why}")


async def start_fleet(groups: Sequence[EngineGroupConfig], kinds: Sequence[EngineKind], ctx: FleetContext,
                      stack: AsyncExitStack, options: FleetConfig | None = None) -> Router:
    """Every group's engines, started concurrently, behind one started router (torn down by ``stack``)."""
    from miles_engine.engines.router import Router

    options = options or FleetConfig()
    check_precision(ctx.weight_format, ctx.kv_cache, groups, kinds)
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


def eval_engine_group(cfg: Any) -> Any:
    """``eval.engine``, else one embedded engine with the first training group's dtype and device
    (and its options when that group is embedded)."""
    if cfg.eval.engine is not None:  # named "eval" unless named: its engines are eval-0, eval-1, ... in logs
        engine = cfg.eval.engine
        return engine if engine.name else engine.model_copy(update={"name": "eval"})
    group = cfg.engines[0]
    options = dict(group.options) if group.kind == "embedded" else {}
    return EngineGroupConfig(kind="embedded", name="eval", dtype=group.dtype, device=group.replica_device(0),
                             options=options)


def eval_transport(group: Any, kind: Any) -> str:
    """How snapshots reach the eval engines: in-process ones share tensors, others take a broadcast."""
    name = "colocated" if kind.in_process else "broadcast"
    if name not in tuple(kind.transports):
        raise ConfigError(f"eval.engine.kind={group.kind!r}: its engines take weights by {list(kind.transports)}, "
                          f"but an eval engine is fed snapshots by {name!r}; pick an eval.engine.kind that takes it "
                          f"(embedded, server, sglang, external)")
    return name

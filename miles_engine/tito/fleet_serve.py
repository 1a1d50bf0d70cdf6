"""A TITO session server in front of a fleet: several engines (launched ``server`` processes,
``external`` URLs, or any engines section) behind one router, for harnesses in other processes
or sandboxes (an OpenAI-SDK agent, a Harbor agent)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from miles_engine.errors import ConfigError


def fleet_groups(model: str | None, engine_urls: Sequence[str], replicas: int, engines_yaml: str | None) -> list[Any]:
    """The engine groups asked for on the command line (one of --engines, --engine-url, --replicas)."""
    from miles_engine.engines.fleet.config import EngineGroupConfig

    if engines_yaml:
        from miles_engine.errors import format_validation_error

        example = "e.g. --engines '[{kind: server, replicas: 2}]'"
        try:
            raw = yaml.safe_load(engines_yaml)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--engines: not YAML ({str(exc).splitlines()[0]}); {example}") from exc
        try:
            return TypeAdapter(list[EngineGroupConfig]).validate_python(raw)
        except ValidationError as exc:
            why = "; ".join(format_validation_error(exc, prefix="engines").splitlines())
            raise ConfigError(f"--engines: not a list of engine groups: {why}; {example}") from exc
    if engine_urls:
        return [EngineGroupConfig(kind="external", replicas=len(engine_urls), options={"urls": list(engine_urls)})]
    if not model:
        raise ConfigError("give --model (engines launched here), --engine-url (servers someone else runs) or --engines")
    return [EngineGroupConfig(kind="server", replicas=replicas)]


async def start_fleet_router(groups: Sequence[Any], model: str | None, stack: AsyncExitStack, *,
                             state_dir: Path, hub: Any = None) -> Any:
    from miles_engine.engines.fleet.build import create_kinds, start_fleet
    from miles_engine.engines.fleet.kinds import FleetContext
    from miles_engine.hub import default_hub

    kinds = create_kinds(hub or default_hub(), groups)
    return await start_fleet(groups, kinds, FleetContext(model=model, state_dir=state_dir), stack)


async def serve_fleet(codec: Any, groups: Sequence[Any], model: str | None, *, host: str, port: int,
                      port_file: str | None, config: Any, state_dir: Path) -> None:
    """Serve sessions until cancelled; every engine this started is stopped on the way out."""
    from miles_engine.tito.serve import fit_tiny_spec, start_session_server

    import signal

    model = fit_tiny_spec(model, codec.tokenizer) if model else model
    task = asyncio.current_task()
    if task is not None:  # SIGTERM unwinds like Ctrl-C: every engine this started is stopped
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    async with AsyncExitStack() as stack:
        router = await start_fleet_router(groups, model, stack, state_dir=state_dir)
        bg = await start_session_server(router, codec, host=host, port=port, config=config)
        stack.push_async_callback(bg.stop)
        names = ", ".join(s.name for s in router.slots)
        print(f"TITO session server on {bg.url} (family {codec.name}) over {len(router.slots)} engine(s): "
              f"{names}; POST /sessions", flush=True)
        if port_file:
            Path(port_file).write_text(str(bg.port))
        await asyncio.shield(bg.task)

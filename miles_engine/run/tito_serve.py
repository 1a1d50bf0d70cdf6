"""``miles tito serve``: a TITO session server for harnesses in other processes or sandboxes (an
OpenAI-SDK agent, a Harbor agent), in front of one engine (the embedded one: ``--model`` a directory,
``.gguf``, ``config.json`` or ``tiny:<type>``, a ``tiny:`` model getting the tokenizer's vocabulary
size; or an SGLang-compatible server, ``--engine-url``) or of a fleet (launched ``server`` processes,
``external`` URLs, or any engines section) behind one router."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from miles_engine.engines.fleet.build import create_kinds, start_fleet
from miles_engine.engines.fleet.config import EngineGroupConfig
from miles_engine.engines.fleet.kinds import FleetContext
from miles_engine.errors import ConfigError, format_validation_error
from miles_engine.hub import Hub
from miles_engine.models.source import fit_tiny_spec
from miles_engine.models.tokenizer import TitoTokenizer
from miles_engine.tito.serve import start_session_server


def fleet_groups(model: str | None, engine_urls: Sequence[str], replicas: int, engines_yaml: str | None) -> list[Any]:
    """The engine groups asked for on the command line (one of --engines, --engine-url, --replicas)."""
    if engines_yaml:
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
                             state_dir: Path, hub: Hub) -> Any:
    kinds = create_kinds(hub, groups)
    return await start_fleet(groups, kinds, FleetContext(model=model, state_dir=state_dir), stack)


async def serve_fleet(codec: Any, groups: Sequence[Any], model: str | None, *, host: str, port: int,
                      port_file: str | None, config: Any, state_dir: Path, hub: Hub) -> None:
    """Serve sessions until cancelled; every engine this started is stopped on the way out."""
    model = fit_tiny_spec(model, codec.tokenizer.vocab_size) if model else model
    task = asyncio.current_task()
    if task is not None:  # SIGTERM unwinds like Ctrl-C: every engine this started is stopped
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    async with AsyncExitStack() as stack:
        router = await start_fleet_router(groups, model, stack, state_dir=state_dir, hub=hub)
        bg = await start_session_server(router, codec, host=host, port=port, config=config)
        stack.push_async_callback(bg.stop)
        names = ", ".join(s.name for s in router.slots)
        print(f"TITO session server on {bg.url} (family {codec.name}) over {len(router.slots)} engine(s): "
              f"{names}; POST /sessions", flush=True)
        if port_file:
            Path(port_file).write_text(str(bg.port))
        await asyncio.shield(bg.task)


async def build_engine(model: str | None, engine_url: str | None, tokenizer: TitoTokenizer, *,
                       threads: int | None = None, dtype: str | None = None) -> Any:
    if engine_url:
        try:
            from miles_engine.engines.http.client import HttpEngine
        except ImportError as exc:
            raise ConfigError(f"--engine-url needs the HTTP engine client ({exc})") from exc
        engine = HttpEngine(engine_url)
        await engine.connect()
        return engine
    if not model:
        raise ConfigError("give --model (embedded engine) or --engine-url (SGLang-compatible server)")
    try:
        from miles_engine.engines.embedded import load_engine
    except ImportError as exc:
        raise ConfigError(f"the embedded engine is not available ({exc}); pip install 'miles-engine[engine]'") from exc
    return await asyncio.to_thread(load_engine, fit_tiny_spec(model, tokenizer.vocab_size), dtype=dtype,
                                   threads=threads)


def default_tokenizer(model: str | None, tokenizer: str | None) -> str:
    if tokenizer:
        return tokenizer
    if model and (model.startswith("package:") or Path(model).is_dir() or Path(model).suffix == ".gguf"):
        return model  # the model's own tokenizer (tokenizer.json / HF dir / the vocabulary inside the GGUF)
    raise ConfigError("give --tokenizer (a tokenizer.json, a model directory or builtin:qwen3 / builtin:bpe-<family>)")


async def run_session_server(engine: Any, codec: Any, *, host: str = "127.0.0.1", port: int = 0,
                             port_file: str | None = None, config: Any = None, log_level: str = "warning") -> None:
    """Serve until cancelled (Ctrl-C). Writes the bound port to ``port_file`` once listening."""
    bg = await start_session_server(engine, codec, host=host, port=port, config=config, log_level=log_level)
    print(f"TITO session server on {bg.url} (family {codec.name}); POST /sessions", flush=True)
    if port_file:
        Path(port_file).write_text(str(bg.port))
    try:
        await bg.task
    finally:
        close = getattr(engine, "aclose", None)
        if close is not None:
            await close()

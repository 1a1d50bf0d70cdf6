"""The engine server process: one engine behind the SGLang-compatible HTTP server, with the
weight-sync routes (:mod:`miles_engine.weights`) mounted. Bind (port 0 picks a free port, reported
through a port file), build the engine from a ``module:function`` factory, serve until
SIGINT/SIGTERM. ``miles serve`` and ``python -m miles_engine.run.engine_server`` (what the
``server`` engine kind and the supervisor launch) run it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import ipaddress
import json
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from miles_engine.engines.http import DEFAULT_ENGINE_FACTORY
from miles_engine.engines.http.server import RouteGroup, create_app
from miles_engine.engines.protocol import RolloutEngine
from miles_engine.errors import MilesError
from miles_engine.weights.disk_delta.engine_server import add_disk_delta_routes
from miles_engine.weights.endpoints import add_weight_sync_routes

log = logging.getLogger(__name__)


WEIGHT_ROUTES: tuple[RouteGroup, ...] = (
    lambda app, engine, lock, parse: add_weight_sync_routes(app, engine, update_lock=lock, parse=parse),
    lambda app, engine, lock, parse: add_disk_delta_routes(app, engine, update_lock=lock, parse=parse),
)


def create_engine_app(engine: RolloutEngine, **options: Any) -> Any:
    """The engine server's app: :func:`~miles_engine.engines.http.server.create_app` plus the
    weight-sync routes (distributed broadcast, checksums, disk_delta)."""
    return create_app(engine, routes=WEIGHT_ROUTES, **options)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def serve(engine: RolloutEngine, *, host: str = "127.0.0.1", port: int = 0, model_path: str | None = None,
                port_file: str | None = None, log_level: str = "warning",
                on_ready: Callable[[int], Any] | None = None) -> None:
    """Serve ``engine`` until cancelled or signalled. ``port=0`` picks a free port, written to
    ``port_file`` (atomically) and passed to ``on_ready``."""
    import uvicorn

    with contextlib.suppress(ValueError):
        if not ipaddress.ip_address(host).is_loopback:
            log.warning("serving on %s: this server has no authentication", host)
    sock = bind_socket(host, port)
    actual = sock.getsockname()[1]
    config = uvicorn.Config(create_engine_app(engine, model_path=model_path), log_level=log_level, timeout_keep_alive=5)
    server = uvicorn.Server(config)
    if port_file:
        tmp = Path(f"{port_file}.tmp")
        tmp.write_text(str(actual))
        tmp.replace(port_file)
    if on_ready is not None:
        on_ready(actual)
    await server.serve(sockets=[sock])


def load_factory(spec: str) -> Callable[..., RolloutEngine | Awaitable[RolloutEngine]]:
    module, _, attr = spec.partition(":")
    if not attr:
        raise MilesError(f"engine factory {spec!r} must look like 'package.module:function'")
    return getattr(importlib.import_module(module), attr)


async def build_engine(factory: str, model: str, *, dtype: str | None = None, threads: int | None = None,
                       options: Mapping[str, Any] | None = None) -> RolloutEngine:
    if threads:
        import torch

        torch.set_num_threads(threads)
    engine = load_factory(factory)(model, dtype=dtype, threads=threads, **dict(options or {}))
    return await engine if inspect.isawaitable(engine) else engine


def run_standalone(model: str, *, host: str = "127.0.0.1", port: int = 30000, port_file: str | None = None,
                   dtype: str | None = None, threads: int | None = None,
                   engine_factory: str = DEFAULT_ENGINE_FACTORY, log_level: str = "warning",
                   engine_options: str | Mapping[str, Any] | None = None, exit_with_parent: bool = False) -> None:
    """Build the engine and serve it until SIGINT/SIGTERM (``miles serve`` and ``python -m``);
    ``exit_with_parent``: also when the process that launched it is gone (SIGKILLed driver)."""
    options = json.loads(engine_options) if isinstance(engine_options, str) else engine_options
    if options is not None and not isinstance(options, Mapping):
        raise MilesError(f"--engine-options must be a JSON object, got {engine_options!r}")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def _run() -> None:
        engine = await build_engine(engine_factory, model, dtype=dtype, threads=threads, options=options)
        ready = lambda p: print(f"miles-engine serving {model} on http://{host}:{p}", flush=True)  # noqa: E731
        await serve(engine, host=host, port=port, model_path=model, port_file=port_file,
                    log_level=log_level, on_ready=ready)

    def _exit(signum: int, _: Any) -> None:  # uvicorn re-raises SIGTERM after its graceful shutdown
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _exit)
    if exit_with_parent:
        watch_parent()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_run())


def watch_parent(interval_s: float = 0.5) -> None:
    """SIGTERM this process once its parent is gone (it was re-parented): a launched engine never
    outlives the run that launched it, even one killed with SIGKILL."""
    import os
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        log.warning("parent process %d is gone: shutting down", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m miles_engine.run.engine_server", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="model directory, config.json, .gguf, or tiny:<type> spec")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--port-file", help="write the bound port here once listening (use with --port 0)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--engine-factory", default=DEFAULT_ENGINE_FACTORY, help="module:function building the engine")
    p.add_argument("--engine-options", default=None, help="JSON object of more keyword options for the factory")
    p.add_argument("--exit-with-parent", action="store_true", help="stop when the launching process is gone")
    p.add_argument("--log-level", default="warning")
    run_standalone(**{k.replace("-", "_"): v for k, v in vars(p.parse_args(argv)).items()})


if __name__ == "__main__":
    main()

"""Start a rollout engine plus a session server for external harnesses (``miles tito serve``).

The engine is the embedded one (``--model``: a directory, ``.gguf``, ``config.json`` or
``tiny:<type>``; a ``tiny:`` model gets the tokenizer's vocabulary size) or an
SGLang-compatible server (``--engine-url``).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from miles_engine.errors import ConfigError
from miles_engine.tito import local
from miles_engine.models.tokenizer import TitoTokenizer


def fit_tiny_spec(model: str, tokenizer: TitoTokenizer) -> str:
    """``tiny:qwen3`` → ``tiny:qwen3,vocab_size=<tokenizer's>`` unless a size is given."""
    if model.startswith("tiny:") and "vocab_size=" not in model:
        return f"{model},vocab_size={tokenizer.vocab_size}"
    return model


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
    return await asyncio.to_thread(load_engine, fit_tiny_spec(model, tokenizer), dtype=dtype, threads=threads)


def default_tokenizer(model: str | None, tokenizer: str | None) -> str:
    if tokenizer:
        return tokenizer
    if model and (model.startswith("package:") or Path(model).is_dir() or Path(model).suffix == ".gguf"):
        return model  # the model's own tokenizer (tokenizer.json / HF dir / the vocabulary inside the GGUF)
    raise ConfigError("give --tokenizer (a tokenizer.json, a model directory or builtin:qwen3 / builtin:bpe-<family>)")


class BackgroundServer:
    """A session server running as a task in the current event loop (``await .stop()`` ends it)."""

    def __init__(self, server: Any, task: asyncio.Task[Any], host: str, port: int) -> None:
        self.server, self.task, self.host, self.port = server, task, host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        local.unregister(self.url)
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), 10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self.task.cancel()


async def start_session_server(engine: Any, codec: Any, *, host: str = "127.0.0.1", port: int = 0,
                               config: Any = None, log_level: str = "warning") -> BackgroundServer:
    """Start a session server in this event loop and wait until it listens."""
    import uvicorn

    from miles_engine.tito.server import create_app
    from miles_engine.tito.service import SessionManager

    class EmbeddedServer(uvicorn.Server):
        """Leaves signal handling to the host program (uvicorn would take SIGINT and re-raise it
        at shutdown, turning a graceful Ctrl-C into an abort)."""

        def capture_signals(self):  # type: ignore[no-untyped-def]
            return contextlib.nullcontext()

    manager = SessionManager(engine, codec, config)
    app = create_app(manager)
    # keep-alive must outlast the agents' pooled idle connections (tito.client: 15 s), or a client
    # reuses a socket the server just closed and the episode fails with "connection reset"
    server = EmbeddedServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           lifespan="off", access_log=False, timeout_keep_alive=75))
    task = asyncio.create_task(server.serve(), name="tito-session-server")
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if task.done():
        task.result()  # re-raises why it could not start
        raise ConfigError(f"the session server on {host}:{port} stopped before listening")
    bound = server.servers[0].sockets[0].getsockname()[1]
    background = BackgroundServer(server, task, host, bound)
    local.register(background.url, app)  # agents in this process may skip the socket (client: local)
    return background


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

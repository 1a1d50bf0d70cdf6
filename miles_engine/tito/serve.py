"""A session server as a task of the current event loop, in front of any engine or router (the
training run's, a served eval policy's, ``miles tito serve``'s)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from miles_engine.errors import ConfigError
from miles_engine.tito import local
from miles_engine.tito.service import SessionManager


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

"""In-process calls to a session server that lives in this process (agent option ``client: local``).

A server started with :func:`~miles_engine.tito.serve.start_session_server` registers its ASGI
app under its URL. A client in the same process and event loop can then hand each request
to that app directly: the same routes, validation and status codes as over HTTP, without the
socket, the HTTP parser on either side or an HTTP client. The routes every episode hits go
straight to their endpoint when the app offers that (``app.state.direct``; its error handler
still maps every failure), the rest through the whole app. The server keeps
listening for everyone else (external harnesses, ``curl``); a URL this process does not serve
goes over HTTP as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

App = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
               Awaitable[None]]
_APPS: dict[str, tuple[App, asyncio.AbstractEventLoop]] = {}


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def register(url: str, app: App) -> None:
    _APPS[_origin(url)] = (app, asyncio.get_running_loop())


def unregister(url: str) -> None:
    _APPS.pop(_origin(url), None)


def app_for(url: str) -> App | None:
    """The app serving ``url`` from this process and this event loop, else ``None``."""
    found = _APPS.get(_origin(url))
    if found is None:
        return None
    app, loop = found
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return app if running is loop else None


async def _direct(app: App, scope: dict[str, Any], receive: Any) -> Any:
    """The app's own fast dispatch of its hot routes (``app.state.direct``, see
    :func:`miles_engine.tito.server.create_app`), when no user middleware would be skipped."""
    direct = getattr(getattr(app, "state", None), "direct", None)
    if direct is None or getattr(app, "user_middleware", None):
        return None
    return await direct(scope, receive)


class LocalResponseError(RuntimeError):
    """The app failed before it sent a response (over HTTP: a connection error)."""


async def request(app: App, method: str, url: str, body: bytes | None,
                  headers: dict[str, str]) -> tuple[int, bytes]:
    """One HTTP/1.1 request through ``app``; returns (status, body)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    raw_headers.append((b"host", parts.netloc.encode("latin-1")))
    if body is not None:
        raw_headers.append((b"content-length", str(len(body)).encode()))
    path = parts.path or "/"
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": method.upper(), "scheme": parts.scheme or "http", "path": path,
        "raw_path": path.encode("latin-1"), "query_string": parts.query.encode("latin-1"), "root_path": "",
        "headers": raw_headers, "client": ("127.0.0.1", 0), "server": (host, port),
    }
    sent_body = False
    finished = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body or b"", "more_body": False}
        await finished.wait()  # like a client that stays connected until the response is complete
        return {"type": "http.disconnect"}

    status: int | None = None
    chunks: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                finished.set()

    try:
        response = await _direct(app, scope, receive)
        if response is not None:
            await response(scope, receive, send)
        else:
            await app(scope, receive, send)
    except Exception as exc:
        if status is None or not finished.is_set():  # over HTTP the server would have dropped the connection
            raise LocalResponseError(f"{method} {url}: the in-process session server failed: "
                                     f"{type(exc).__name__}: {exc}") from exc
    finally:
        finished.set()
    if status is None:
        raise LocalResponseError(f"{method} {url}: the in-process session server sent no response")
    return status, b"".join(chunks)

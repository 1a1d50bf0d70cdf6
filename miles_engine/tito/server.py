"""The TITO session server: FastAPI over a :class:`SessionManager` (loopback by default); the
routes of every episode (open, chat, close) are plain Starlette routes.

Endpoints::

    GET    /health
    GET    /metrics                                   mismatch rates, overhead percentiles
    POST   /sessions                                  {"mode"?, "matcher"?, "metadata"?}
                                                      → {"session_id", "base_url": ".../v1"}
    GET    /sessions/{id}                             summary
    DELETE /sessions/{id}[?trajectories=true]         also returns the trajectories report
    GET    /sessions/{id}/trajectories                token rows + diagnostic
    POST   /sessions/{id}/v1/chat/completions         OpenAI chat completions (JSON or SSE)
    POST   /sessions/{id}/v1/messages[/count_tokens]  Anthropic Messages (JSON or SSE), see .anthropic_api
    POST   /sessions/{id}/v1/responses                OpenAI Responses (JSON or SSE), see .responses_api
    GET    /sessions/{id}/v1/models

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from miles_engine.fastapi_app import new_fastapi_app
from miles_engine.tito import wire
from miles_engine.tito.errors import BadRequest, RequestTooLarge, TitoError
from miles_engine.tito.wire_routes import add_wire_routes
from miles_engine.tito.service import SessionManager

log = logging.getLogger(__name__)
INLINE_REPORT_GENERATIONS = 4  # larger sessions assemble their report off the event loop


def create_app(manager: SessionManager) -> FastAPI:
    app = new_fastapi_app(otel=manager.config.otel, title="miles TITO session server", docs_url=None,
                          redoc_url=None, openapi_url=None)
    app.state.manager = manager

    @app.exception_handler(TitoError)
    @app.exception_handler(Exception)
    async def _error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    async def read_json(request: Request, *, allow_empty: bool = False) -> Any:
        limit = manager.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestTooLarge(f"the request body is {declared} bytes, over this server's max_request_bytes "
                                  f"{limit}", param="body")
        raw = await request.body()
        if len(raw) > limit:
            raise RequestTooLarge(f"the request body is {len(raw)} bytes, over this server's max_request_bytes "
                                  f"{limit}", param="body")
        if not raw.strip():
            if allow_empty:
                return {}
            raise BadRequest("the request body is empty; expected a JSON object")
        try:
            return wire.loads(raw)
        except ValueError as exc:
            raise BadRequest(f"malformed JSON body: {exc}") from None

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "family": manager.codec.name, "sessions": len(manager.sessions)}

    @app.get("/metrics")
    async def metrics() -> dict[str, Any]:
        return manager.metrics()

    # The routes every episode hits (open, chat, collect-and-close) are plain Starlette routes:
    # FastAPI's per-request dependency solving was ~11 % of the driver's GIL time in the recipe.
    async def create_session(request: Request) -> Response:
        session = manager.create(await read_json(request, allow_empty=True))
        base = str(request.base_url).rstrip("/")
        return Response(wire.dumps({"session_id": session.id, "base_url": f"{base}/sessions/{session.id}/v1",
                                    "mode": session.mode}), media_type="application/json")

    app.add_route("/sessions", create_session, methods=["POST"], include_in_schema=False)

    @app.get("/sessions/{session_id}")
    async def get_session(session_id: str) -> dict[str, Any]:
        s = manager.get(session_id)
        return {"session_id": s.id, "mode": s.mode, "generations": len(s.nodes),
                "trajectories": len(s.kept_leaves()), "busy": s.busy, "metadata": s.metadata}

    async def report_of(session_id: str) -> dict[str, Any]:
        if len(manager.get(session_id).nodes) <= INLINE_REPORT_GENERATIONS:  # a thread hop costs more
            return manager.trajectories(session_id)
        return await asyncio.to_thread(manager.trajectories, session_id)

    async def delete_session(request: Request) -> Response:
        """``?trajectories=true``: the session's trajectories report too (collect and close in
        one request, the end of every episode)."""
        session_id = request.path_params["session_id"]
        report = await report_of(session_id) if query_flag(request, "trajectories") else {}
        report.update(await manager.delete(session_id))
        return Response(wire.dumps(report), media_type="application/json")

    app.add_route("/sessions/{session_id}", delete_session, methods=["DELETE"], include_in_schema=False)

    @app.get("/sessions/{session_id}/trajectories")
    async def trajectories(session_id: str) -> Response:
        report = await report_of(session_id)
        return Response(wire.dumps(report), media_type="application/json")

    @app.get("/sessions/{session_id}/v1/models")
    async def models(session_id: str) -> dict[str, Any]:
        manager.get(session_id)
        return {"object": "list", "data": [{"id": manager.config.model_name, "object": "model",
                                            "created": 0, "owned_by": "miles"}]}

    async def chat(request: Request) -> Response:
        session_id = request.path_params["session_id"]
        manager.get(session_id)
        completion, req = await manager.chat(session_id, await read_json(request))
        if req.stream:
            events = completion.sse(req.include_usage)
            return StreamingResponse(iter(events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return Response(wire.dumps(completion.body()), media_type="application/json")

    app.add_route("/sessions/{session_id}/v1/chat/completions", chat, methods=["POST"], include_in_schema=False)
    add_wire_routes(app, manager, read_json)

    hot = [("POST", re.compile(r"/sessions"), create_session),
           ("DELETE", re.compile(r"/sessions/(?P<session_id>[^/]+)"), delete_session),
           ("POST", re.compile(r"/sessions/(?P<session_id>[^/]+)/v1/chat/completions"), chat)]

    async def direct(scope: dict[str, Any], receive: Any) -> Response | None:
        """The routes every episode hits, for an in-process caller (:mod:`miles_engine.tito.local`):
        the endpoint itself, errors mapped by the app's own handler, without the middleware
        stack and the route scan (~15 % of the recipe driver's time). None: not one of them."""
        method, path = scope["method"], scope["path"]
        for verb, pattern, endpoint in hot:
            match = pattern.fullmatch(path) if verb == method else None
            if match is not None:
                scope["path_params"] = match.groupdict()
                try:
                    return await endpoint(Request(scope, receive))
                except Exception as exc:
                    return error_response(exc)
        return None

    app.state.direct = direct
    return app


def error_response(exc: Exception) -> JSONResponse:
    """The JSON error of a failed request: a :class:`TitoError`'s status and body, else a 500."""
    if isinstance(exc, TitoError):
        return JSONResponse(exc.body(), status_code=exc.status)
    log.error("session server error", exc_info=exc)
    err = TitoError(f"internal error: {type(exc).__name__}: {exc}")
    return JSONResponse(err.body(), status_code=500)


_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "f", "no", "n", "off"})


def query_flag(request: Request, name: str) -> bool:
    """A boolean query parameter (absent: false), spelled as FastAPI would accept it."""
    raw = request.query_params.get(name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise BadRequest(f"query parameter {name!r} must be a boolean (true or false), got {raw!r}", param=name)


class ServerThread:
    """Run the app with uvicorn on ``host:port`` in a background thread (port 0: ephemeral).

    The engine's coroutines run on this thread's event loop.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                     access_log=False)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="tito-session-server")
        self.url = ""

    def start(self, timeout: float = 20.0) -> str:
        self.thread.start()
        waited = 0.0
        while not self.server.started:
            if not self.thread.is_alive() or waited > timeout:
                raise RuntimeError("the session server did not start")
            threading.Event().wait(0.02)
            waited += 0.02
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


@contextmanager
def serve_in_thread(manager: SessionManager, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """``with serve_in_thread(manager) as url:`` — a real HTTP server for the block."""
    srv = ServerThread(create_app(manager), host, port)
    url = srv.start()
    try:
        yield url
    finally:
        srv.stop()

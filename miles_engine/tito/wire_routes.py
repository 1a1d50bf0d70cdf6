"""The Anthropic Messages and OpenAI Responses routes of a session (the chat-completions route
lives in :mod:`.server`): each translates its wire format into normalised messages, runs the
same turn pipeline (:meth:`~miles_engine.tito.service.SessionManager.serve`) and renders the
committed turn back in its own format, JSON or SSE. Messages errors use Anthropic's error shape."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from miles_engine.tito import anthropic_api, responses_api, wire
from miles_engine.tito.api import ChatRequest
from miles_engine.tito.errors import TitoError
from miles_engine.tito.service import SessionManager, Turn
from miles_engine.tito.session import Session

STORED_RESPONSES = 256  # per session, for previous_response_id


def _sse(events: list[str]) -> StreamingResponse:
    return StreamingResponse(iter(events), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def add_wire_routes(app: FastAPI, manager: SessionManager, read_json: Callable[[Request], Awaitable[Any]]) -> None:
    family = manager.codec.family
    reasoning = family.has_reasoning

    async def messages(request: Request) -> Response:
        session_id = request.path_params["session_id"]
        try:
            manager.get(session_id)
            body = await read_json(request)

            def parse(session: Session) -> ChatRequest:
                history, cache = session.wire_history.get("messages", (None, None))
                req, chat, history = anthropic_api.parse_messages_request(body, family, cache, history=history)
                session.wire_history["messages"] = (history, list(zip(chat, req.messages)))
                return req

            turn, req = await manager.serve(session_id, parse, wire="messages")
        except TitoError as exc:
            return JSONResponse(anthropic_api.error_body(exc), status_code=exc.status)
        out = anthropic_api.message_body(turn, manager.config.model_name, with_reasoning=reasoning)
        if req.stream:
            return _sse(anthropic_api.message_sse(out))
        return Response(wire.dumps(out), media_type="application/json")

    async def count_tokens(request: Request) -> Response:
        session_id = request.path_params["session_id"]
        try:
            history, cache = manager.get(session_id).wire_history.get("messages", (None, None))
            req, _, _ = anthropic_api.parse_messages_request(await read_json(request), family, cache,
                                                             count_only=True, history=history)
            count = manager.count_prompt(session_id, req)
        except TitoError as exc:
            return JSONResponse(anthropic_api.error_body(exc), status_code=exc.status)
        return Response(wire.dumps({"input_tokens": count}), media_type="application/json")

    async def responses(request: Request) -> Response:
        session_id = request.path_params["session_id"]
        manager.get(session_id)
        body = await read_json(request)
        response_id = f"resp_{uuid.uuid4().hex}"

        def parse(session: Session) -> ChatRequest:
            history, cache = session.wire_history.get("responses", (None, None))
            req, chat, history = responses_api.parse_responses_request(body, family, session.responses, cache,
                                                                       history)
            if body.get("previous_response_id") is None:
                session.wire_history["responses"] = (history, list(zip(chat, req.messages)))
            return req

        def remember(session: Session, req: ChatRequest, turn: Turn) -> None:
            session.responses[response_id] = [*req.messages, turn.assistant]
            while len(session.responses) > STORED_RESPONSES:
                session.responses.pop(next(iter(session.responses)))

        turn, req = await manager.serve(session_id, parse, on_commit=remember, wire="responses")
        out = responses_api.response_body(turn, req, manager.config.model_name, with_reasoning=reasoning,
                                          response_id=response_id)
        out["previous_response_id"] = body.get("previous_response_id")
        if req.stream:
            return _sse(responses_api.response_sse(out))
        return Response(wire.dumps(out), media_type="application/json")

    app.add_route("/sessions/{session_id}/v1/messages", messages, methods=["POST"], include_in_schema=False)
    app.add_route("/sessions/{session_id}/v1/messages/count_tokens", count_tokens, methods=["POST"],
                  include_in_schema=False)
    app.add_route("/sessions/{session_id}/v1/responses", responses, methods=["POST"], include_in_schema=False)

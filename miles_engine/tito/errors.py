"""HTTP-facing errors of the session server, rendered in OpenAI's error shape.

Every error names what was wrong and what to do; ``param`` points at the offending field
(``messages[3].tool_calls[0].function.arguments``) so a harness author can find it.
"""

from __future__ import annotations

from typing import Any


class TitoError(Exception):
    status = 500
    type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(TitoError):
    """The message names the offending field (``param``) even for clients that show only it."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        if param and param not in message:
            message = f"{param}: {message}"
        super().__init__(message, param=param, code=code)


class RequestTooLarge(TitoError):
    status = 413
    type = "invalid_request_error"


class SessionNotFound(TitoError):
    status = 404
    type = "not_found_error"


class Conflict(TitoError):
    """The request is well-formed but cannot apply to the session's current state."""

    status = 409
    type = "conflict_error"


class TooManySessions(TitoError):
    status = 429
    type = "rate_limit_error"


class EngineFailed(TitoError):
    status = 502
    type = "engine_error"


class GenerationAborted(TitoError):
    status = 503
    type = "engine_unavailable"


class TemplateError(TitoError):
    """The family's template cannot render this history append-only (a family bug)."""

    status = 500
    type = "template_error"


class MatcherError(TitoError):
    status = 500
    type = "matcher_error"

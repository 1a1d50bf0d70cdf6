"""Errors raised by engine transports, the router and the supervisor (not by bad input:
a request the engine refuses raises :class:`ValueError`, and HTTP maps it to 400)."""

from __future__ import annotations

from miles_engine.errors import MilesError


class EngineUnavailable(MilesError):
    """The engine did not answer (connection refused or reset, process gone, quarantined).
    Over HTTP this is a 503; the fault-tolerance layer may retry the request elsewhere."""


class EngineCrashLoop(EngineUnavailable):
    """An engine process kept dying on restart; the supervisor gave up (message has the log tail)."""


class EngineServerError(RuntimeError):
    """The engine answered 5xx: a bug or fault inside it, not the caller's input."""


class EngineRefusedUpdate(MilesError):
    """An engine server refused a weight update it understood (an HTTP error with its answer); it
    keeps its old weights. The weight transport that asked turns it into its own error."""

    def __init__(self, url: str, status: int | None = None, body: object = None, message: str | None = None,
                 version: int | None = None) -> None:
        if status is None:  # refused by the client before the server saw it: ``url`` is the whole message
            super().__init__(url)
        else:
            super().__init__(f"engine {url} refused the update to weight version {version} (HTTP {status}): "
                             f"{message}")
        self.url, self.status, self.body, self.message, self.version = url, status, body, message or url, version

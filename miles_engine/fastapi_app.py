"""The FastAPI app of the stack's HTTP servers (the TITO session server, the engine server)."""

from __future__ import annotations

import inspect
from typing import Any


def new_fastapi_app(*, otel: bool = False, **kwargs: Any) -> Any:
    """``FastAPI(**kwargs)`` with FastAPI's native OpenTelemetry off unless ``otel``.

    FastAPI ≥ 0.16x asks the OpenTelemetry API on every request whether a tracer, meter or
    logger provider is configured: ~4 % of the recipe driver's CPU at ~150 short episodes/s,
    for nothing when no provider is set. Versions without native telemetry ignore ``otel``.
    """
    from fastapi import FastAPI

    if not otel and "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        kwargs["telemetry"] = {"tracing": False, "metrics": False, "logs": False}
    return FastAPI(**kwargs)

"""Options of the Daytona sandbox backend."""

from __future__ import annotations

from pydantic import Field

from miles_engine.sandbox.remote_transport import RemoteExecOptions


class DaytonaSandboxOptions(RemoteExecOptions):
    """Credentials come from ``DAYTONA_API_KEY`` (``DAYTONA_API_URL`` and ``DAYTONA_TARGET``
    optional), never from options."""

    snapshot: str | None = Field(None, description="Daytona snapshot for specs without image/build (default: Daytona's)")
    default_image: str = Field(
        "python:3.12-slim", description="image used when a spec asks for resources but names no image"
    )
    create_timeout_s: float = Field(180.0, gt=0, description="how long one create (incl. an image build) may take")
    auto_stop_minutes: int = Field(60, ge=0, description="stop a sandbox idle this long (0: never); it is then deleted")
    run_id: str | None = Field(None, description="run label for sandboxes whose spec has none (default: $MILES_RUN_ID)")

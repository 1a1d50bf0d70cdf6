"""Options of the Modal sandbox backend."""

from __future__ import annotations

from pydantic import Field

from miles_engine.sandbox.remote_transport import RemoteExecOptions


class ModalSandboxOptions(RemoteExecOptions):
    """Credentials come from ``MODAL_TOKEN_ID`` and ``MODAL_TOKEN_SECRET``, never from options."""

    app_name: str = Field("miles-sandboxes", min_length=1, description="Modal app the sandboxes belong to (created if missing)")
    default_image: str = Field("python:3.12-slim", description="registry image for specs that name none")
    lifetime_s: int = Field(3600, gt=0, description="sandbox lifetime when the spec sets no ttl_s")
    gpu: str | None = Field(None, description="Modal GPU type (e.g. 'A10G') used for specs asking for GPUs")
    run_id: str | None = Field(None, description="run label for sandboxes whose spec has none (default: $MILES_RUN_ID)")

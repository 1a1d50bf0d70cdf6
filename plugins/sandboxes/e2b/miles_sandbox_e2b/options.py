"""Options of the E2B sandbox backend."""

from __future__ import annotations

from pydantic import Field

from miles_engine.sandbox.remote_transport import RemoteExecOptions


class E2BSandboxOptions(RemoteExecOptions):
    """Credentials come from ``E2B_API_KEY`` (and ``E2B_DOMAIN`` for self-hosted E2B), never
    from options, so recipes can be shared without secrets."""

    template: str | None = Field(
        None, description="prebuilt E2B template for specs without image/build/resources (default: E2B's 'base')"
    )
    lifetime_s: int = Field(3600, gt=0, description="sandbox lifetime when the spec sets no ttl_s")
    request_timeout_s: float = Field(60.0, gt=0, description="timeout of one E2B API request")
    run_id: str | None = Field(None, description="run label for sandboxes whose spec has none (default: $MILES_RUN_ID)")
    template_prefix: str = Field("miles", pattern=r"^[a-z0-9][a-z0-9-]*$", description="name prefix of built templates")

"""Options of the Docker sandbox backend (validated by the hub; unknown keys are errors)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_engine.sandbox.protocol import DEFAULT_MAX_OUTPUT_BYTES
from miles_engine.sandbox.remote import RetryPolicy


class DockerSandboxOptions(BaseModel):
    """How the Docker backend reaches the engine and shapes its containers."""

    model_config = ConfigDict(extra="forbid")

    binary: str = Field("docker", description="the docker CLI: a name on PATH or an absolute path")
    host: str | None = Field(None, description="engine address (sets DOCKER_HOST for the CLI); default: the CLI's context")
    run_id: str | None = Field(
        None, description="run id labelled on every container (default: $MILES_RUN_ID, else one per process)"
    )
    default_image: str = Field(
        "debian:bookworm-slim", description="image for specs that name none (needs /bin/sh; bash for string commands)"
    )
    pull: Literal["missing", "always", "never"] = Field("missing", description="when to pull a registry image")
    public_network: str = Field("bridge", description="docker network used for network mode 'public'")
    gpus: bool = Field(False, description="the engine has the NVIDIA runtime: allow specs asking for GPUs")
    max_cpus: float | None = Field(None, gt=0, description="refuse specs asking for more CPUs")
    max_memory_mb: int | None = Field(None, gt=0, description="refuse specs asking for more memory")
    enforce_disk: bool = Field(
        False, description="pass spec.resources.disk_mb as --storage-opt size= (needs overlay2 on xfs with pquota)"
    )
    pids_limit: int | None = Field(4096, gt=0, description="--pids-limit per container (fork bombs)")
    default_timeout_s: float = Field(120.0, gt=0, description="exec timeout when none is given")
    max_output_bytes: int = Field(DEFAULT_MAX_OUTPUT_BYTES, gt=0, description="per-stream output cap")
    max_transfer_mb: int = Field(2048, gt=0, description="cap on read_file/download_dir transfers")
    call_timeout_s: float = Field(120.0, gt=0, description="bound on one docker call (run, cp, rm...)")
    pull_timeout_s: float = Field(900.0, gt=0, description="bound on one image pull")
    build_timeout_s: float = Field(1800.0, gt=0, description="bound on one image build")
    kill_timeout_s: float = Field(10.0, gt=0, description="bound on killing a timed-out command's process tree")
    retry: RetryPolicy = Field(default_factory=RetryPolicy, description="backoff for idempotent docker calls")

"""Options of the Docker sandbox backend (validated by the hub; unknown keys are errors)."""

from __future__ import annotations

import os
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from miles_engine.components import Section
from miles_engine.errors import ConfigError, SandboxError
from miles_engine.sandbox.protocol import DEFAULT_MAX_OUTPUT_BYTES
from miles_engine.sandbox.remote import RetryPolicy


class DockerSandboxOptions(Section):
    """How the Docker backend reaches the engine and shapes its containers."""

    binary: str = Field(
        default_factory=lambda: os.environ.get("MILES_DOCKER_BINARY") or "docker",
        description="the engine CLI: a name on PATH or an absolute path ('docker', or 'podman' through its "
        "Docker-compatible CLI; 'docker' falls back to 'podman' when only podman is installed); "
        "default: $MILES_DOCKER_BINARY, else docker",
    )
    host: str | None = Field(None, description="engine address (sets DOCKER_HOST for the CLI); default: the CLI's context")
    run_id: str | None = Field(
        None, description="run id labelled on every container (default: $MILES_RUN_ID, else one per process)"
    )
    default_image: str = Field(
        "debian:bookworm-slim", description="image for specs that name none (needs /bin/sh; bash for string commands)"
    )
    pull: Literal["missing", "always", "never"] = Field("missing", description="when to pull a registry image")
    image_map: dict[str, str] = Field(
        default_factory=lambda: _env_map("MILES_DOCKER_IMAGE_MAP"),
        description="image reference -> local or mirror image, applied to spec images and to Dockerfile FROM "
        "lines (e.g. {'ubuntu:24.04': 'mirror.local/ubuntu:24.04'}); default: $MILES_DOCKER_IMAGE_MAP as "
        "'ref=image,ref=image'",
    )
    stand_in: bool = Field(
        True, description="use a stand-in image (stand_ins patterns) where the real one cannot be had: not "
        "present and not pullable under the pull policy (pull errors, or pull='never')")
    stand_ins: dict[str, str] = Field(
        default_factory=lambda: _env_map("MILES_DOCKER_STAND_INS", what="PATTERN=FAMILY_OR_IMAGE"),
        description="image-name glob pattern -> stand-in family (python, python-full, tb-python, tb-ubuntu, "
        "debian, ubuntu, buildpack-deps, alpine, or one of stand_in_families) or an image reference; tried "
        "before the built-in patterns, first match wins; matched without a docker.io/[library/] prefix and a "
        "digest (e.g. {'myorg/py:*': 'python'}); default: $MILES_DOCKER_STAND_INS as 'pattern=target,...'",
    )
    stand_in_families: dict[str, list[str]] = Field(
        default_factory=dict, description="more stand-in families: name -> Debian packages installed on "
        "stand_in_base (e.g. {'node': ['nodejs', 'npm']}); a name of a built-in family replaces it")
    stand_in_defaults: bool = Field(True, description="apply the built-in patterns after stand_ins")
    stand_in_base: str = Field(
        default_factory=lambda: os.environ.get("MILES_DOCKER_STAND_IN_BASE") or "miles-base:bookworm",
        description="the image stand-in families are built FROM (Debian; apt from the Debian mirror during the "
        "build); default: $MILES_DOCKER_STAND_IN_BASE, else miles-base:bookworm (scripts/container_engine.sh)",
    )
    public_network: str = Field(
        default_factory=lambda: os.environ.get("MILES_DOCKER_PUBLIC_NETWORK") or "bridge",
        description="docker network used for network mode 'public' (default: $MILES_DOCKER_PUBLIC_NETWORK, else bridge)",
    )
    build_network: str = Field(
        default_factory=lambda: os.environ.get("MILES_DOCKER_BUILD_NETWORK") or "default",
        description="network of Dockerfile RUN steps: 'default' (the engine's), 'host', 'none' (air-gapped: a "
        "step that needs the network fails at once and is named) or a network name; "
        "default: $MILES_DOCKER_BUILD_NETWORK",
    )
    max_sandboxes: int | None = Field(
        None, gt=0, description="containers alive at once; create() waits for a free slot (None: no limit)"
    )
    max_creates_per_s: float | None = Field(
        None, gt=0, description="container starts per second at most (spreads bursts; None: no limit)"
    )
    sweep_orphans: bool = Field(
        True, description="on first use, remove containers left by dead miles processes of this host "
        "(a SIGKILLed run's leftovers)"
    )
    gpus: bool = Field(False, description="the engine has the NVIDIA runtime: allow specs asking for GPUs")
    max_cpus: float | None = Field(None, gt=0, description="refuse specs asking for more CPUs")
    max_memory_mb: int | None = Field(None, gt=0, description="refuse specs asking for more memory")
    enforce_disk: bool = Field(
        False, description="pass spec.resources.disk_mb as --storage-opt size= (needs overlay2 on xfs with pquota)"
    )
    default_cpus: float | None = Field(
        1.0, gt=0, description="--cpus for specs that ask for none (a runaway command then holds one core, "
        "not the host; None: no cap)"
    )
    pids_limit: int | None = Field(1024, gt=0, description="--pids-limit per container (fork bombs)")
    max_file_size_mb: int | None = Field(
        512, gt=0, description="largest file a command may write (RLIMIT_FSIZE via --ulimit fsize=); a per-file "
        "cap, not a disk quota (see enforce_disk)"
    )
    default_timeout_s: float = Field(120.0, gt=0, description="exec timeout when none is given")
    max_output_bytes: int = Field(DEFAULT_MAX_OUTPUT_BYTES, gt=0, description="per-stream output cap")
    max_transfer_mb: int = Field(2048, gt=0, description="cap on read_file/download_dir transfers")
    call_timeout_s: float = Field(120.0, gt=0, description="bound on one docker call (run, cp, rm...)")
    pull_timeout_s: float = Field(900.0, gt=0, description="bound on one image pull")
    build_timeout_s: float = Field(1800.0, gt=0, description="bound on one image build")
    kill_timeout_s: float = Field(
        10.0, gt=0, description="bound on killing a timed-out command's process tree inside the container; past it "
        "(e.g. a fork bomb at the pids limit) the container is killed and the sandbox is dead"
    )
    ro_binds: dict[str, str] = Field(
        default_factory=dict, description="read-only binds into every sandbox container, container path -> host "
        "path (the engine must be on this host), e.g. {'/miles/harnesses': '/var/cache/miles-engine/harnesses'}: "
        "the coding-agent CLIs the harness agent runs")
    route_image: str = Field(
        "python:3.12-slim", description="image of the forwarder container behind route_to_host (the harness "
        "agent's route to its session server); needs python3; goes through image_map")
    retry: RetryPolicy = Field(default_factory=RetryPolicy, description="backoff for idempotent docker calls")

    @property
    def max_processes(self) -> int | None:
        """The per-container process cap (``pids_limit``), under the local backend's name."""
        return self.pids_limit

    @field_validator("ro_binds")
    @classmethod
    def _ro_binds(cls, binds: dict[str, str]) -> dict[str, str]:
        out = {}
        for path, host in binds.items():
            host = os.path.expanduser(host)
            if not path.startswith("/") or path.rstrip("/") == "" or ":" in path or ":" in host:
                raise ValueError(f"ro_binds: {path!r} must be an absolute container path other than '/' "
                                 "(no ':' in either path)")
            if not os.path.isabs(host) or not os.path.exists(host):
                raise ValueError(f"ro_binds: host path {host!r} (for {path!r}) must be an existing absolute path")
            out[path] = host
        return out

    @field_validator("image_map")
    @classmethod
    def _no_empty_refs(cls, value: dict[str, str]) -> dict[str, str]:
        for ref, image in value.items():
            if not ref.strip() or not image.strip():
                raise ValueError(f"image_map entries need a reference and an image, got {ref!r}: {image!r}")
        return value

    @field_validator("stand_ins")
    @classmethod
    def _stand_in_targets(cls, value: dict[str, str]) -> dict[str, str]:
        for pattern, target in value.items():
            if not pattern.strip() or not target.strip():
                raise ValueError(f"stand_ins entries need a pattern and a family or image, got {pattern!r}: {target!r}")
        return value

    @field_validator("stand_in_families")
    @classmethod
    def _family_packages(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, packages in value.items():
            if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", name):
                raise ValueError(f"stand_in_families: name {name!r} must be lower-case letters, digits, '.', '_', '-'")
            bad = [p for p in packages if not re.fullmatch(r"[a-z0-9][a-z0-9+.:=~-]*", p)]
            if bad or not packages:
                raise ValueError(f"stand_in_families[{name!r}]: {bad or 'no packages'} (want Debian package names)")
        return value

    @model_validator(mode="after")
    def _stand_in_map(self) -> DockerSandboxOptions:
        from miles_sandbox_docker.standins import StandInMap  # an unknown family or a bad image: one error

        try:
            StandInMap.build(self.stand_ins, self.stand_in_families, defaults=self.stand_in_defaults)
        except SandboxError as exc:
            raise ValueError(str(exc)) from exc
        return self


def _env_map(var: str, what: str = "REF=IMAGE") -> dict[str, str]:
    """'a=b,c=d' from the environment as a mapping (a malformed entry is an error naming it)."""
    raw = os.environ.get(var, "").strip()
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        ref, sep, image = item.partition("=")
        if not sep or not ref or not image:
            raise ConfigError(f"${var}: entry {item!r} is not {what} (expected '{what.lower()},{what.lower()}')")
        out[ref] = image
    return out

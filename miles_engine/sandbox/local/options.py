"""Options of the local sandbox backend (validated by the hub; unknown keys are errors)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator

from miles_engine.components import Section
from miles_engine.sandbox.protocol import DEFAULT_MAX_OUTPUT_BYTES

IsolationChoice = Literal["auto", "namespace", "process"]
NamespaceTool = Literal["auto", "bwrap", "unshare"]


class LocalSandboxOptions(Section):
    """How the local backend isolates and limits sandboxes.

    Every ``None`` limit means "not limited". Limits are per process (rlimits), except
    ``max_processes`` which counts all processes of one sandbox's dedicated uid (only
    enforced when the backend runs as root and can give each sandbox its own uid).
    """

    isolation: IsolationChoice = Field(
        "auto", description="'auto' takes namespaces when the kernel allows, else processes"
    )
    namespace_tool: NamespaceTool = Field(
        "auto", description="namespace launcher: bubblewrap preferred, util-linux unshare as fallback"
    )
    cpu_time_s: int | None = Field(600, gt=0, description="RLIMIT_CPU per process (seconds)")
    memory_mb: int | None = Field(2048, gt=0, description="RLIMIT_AS per process (MiB)")
    max_open_files: int | None = Field(1024, gt=0, description="RLIMIT_NOFILE")
    max_file_size_mb: int | None = Field(256, gt=0, description="RLIMIT_FSIZE (MiB)")
    max_processes: int | None = Field(256, gt=0, description="RLIMIT_NPROC for the sandbox uid")
    default_timeout_s: float = Field(120.0, gt=0, description="exec timeout when none is given")
    max_output_bytes: int = Field(DEFAULT_MAX_OUTPUT_BYTES, gt=0, description="per-stream output cap")
    kill_grace_s: float = Field(0.5, ge=0, description="SIGTERM-to-SIGKILL grace on timeout")
    max_transfer_mb: int = Field(2048, gt=0, description="cap on read_file/download_dir transfers")
    scratch_root: str | None = Field(
        None, description="parent of per-sandbox scratch dirs (default: TMPDIR); 'tmpfs': /dev/shm when it is a "
        "tmpfs that allows exec with >= 1 GiB free (sandbox files then live in memory), else TMPDIR with a warning")
    uid_base: int = Field(2_000_000, ge=1000, description="first uid of the per-sandbox uid pool (root only)")
    uid_pool_size: int = Field(65_536, gt=0, le=1_000_000)
    env_passthrough: tuple[str, ...] = Field(
        (), description="extra host variables to pass in besides the built-in allowlist"
    )
    hidden_paths: tuple[str, ...] = Field(
        (), description="extra host directories hidden (empty tmpfs) in the namespace tier"
    )
    ro_binds: dict[str, str] = Field(
        default_factory=dict, description="namespace tier: extra read-only binds, sandbox path -> host path (e.g. "
        "{'/miles/harnesses': '~/.cache/miles-engine/harnesses'}, the coding-agent CLIs the harness agent runs); "
        "a sandbox path must lie under a top-level directory the host does not have")
    keep_scratch: bool = Field(False, description="debug: keep scratch dirs after close")
    exec_via_init: bool = Field(
        True, description="bubblewrap tier: the namespace's PID 1 forks each command (~2 ms of CPU) instead of "
        "joining the namespace with nsenter + setpriv from the host (~7 ms); needed by warm_pool_size")
    warm_pool_size: int = Field(
        0, ge=0, le=4096,
        description="closed namespace sandboxes kept warm for reuse: reset in place (every process but the "
        "namespace's init killed, System V IPC removed, every writable dir emptied) instead of torn down; "
        "0 = a fresh namespace per sandbox. bubblewrap launcher only")

    @field_validator("ro_binds")
    @classmethod
    def _ro_binds(cls, binds: dict[str, str]) -> dict[str, str]:
        out = {}
        for path, host in binds.items():
            top = path.strip("/").split("/")[0]
            if not path.startswith("/") or not top or os.path.lexists("/" + top):
                raise ValueError(f"ro_binds: sandbox path {path!r} must be absolute and under a top-level directory "
                                 f"the host does not have ('/{top}' exists or is empty)")
            host = os.path.expanduser(host)
            if not os.path.exists(host):
                raise ValueError(f"ro_binds: host path {host!r} (for {path!r}) does not exist")
            out[path] = host
        return out

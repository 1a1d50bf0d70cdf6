"""The sandbox protocol every backend implements, and the capability check that guards it.

Semantics every backend must keep (the contract suite checks them):

- ``exec`` never raises because the command failed, timed out or printed too much: it
  returns an :class:`ExecResult` with ``exit_code`` (``None`` when killed on timeout),
  ``timed_out`` and ``truncated``. It raises :class:`~miles_engine.errors.SandboxError`
  only when the sandbox itself is unusable (closed, dead, transport lost).
- ``close`` is idempotent and leaves nothing running.
- A backend never runs a spec it cannot isolate as asked: :func:`check_supported` raises
  :class:`~miles_engine.errors.SandboxUnsupportedError` naming every unmet need.
- ``exec`` runs a string under ``bash -c`` and a list as argv; stdout and stderr stay
  separate; ``cwd``/``env`` apply to that one command on top of the spec's; each stream is
  cut at ``max_output_bytes`` (``truncated`` set) while the command runs to completion.
- Files are binary safe. ``read_file`` raises :class:`FileNotFoundError` for a missing path;
  every path in ``spec.files`` exists when ``create`` returns.
- After ``close`` every operation raises :class:`~miles_engine.errors.SandboxError` and
  ``alive()`` is ``False``.

Remote backends (anything that creates resources outside this process) also keep:

- Every sandbox carries the labels of its spec plus :data:`RUN_LABEL` (the run id: the
  spec's own ``miles.run`` label when set, else the backend's run id) and
  :data:`SANDBOX_LABEL` (the sandbox id), so leftovers of a crashed run can be found.
- They implement :class:`SweepableBackend`: ``sweep(run_id)`` removes every sandbox
  labelled with that run and returns their ids; sweeping again returns ``[]``.
  ``miles sandbox sweep --backend B --run RUN`` calls it.
- Only idempotent calls are retried (create, file I/O, close, sweep): a command given to
  ``exec`` is sent once, never re-dispatched (see :mod:`miles_engine.sandbox.remote`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from miles_engine.errors import SandboxUnsupportedError

IsolationLevel = Literal["process", "namespace", "container", "microvm"]
NetworkMode = Literal["none", "public", "allowlist"]
ISOLATION_ORDER: tuple[IsolationLevel, ...] = ("process", "namespace", "container", "microvm")

DEFAULT_MAX_OUTPUT_BYTES = 1 << 20  # per stream

RUN_LABEL = "miles.run"  # label carrying the run id on every remote sandbox
SANDBOX_LABEL = "miles.sandbox"  # label carrying the sandbox's own id
TASK_LABEL = "miles.task"  # label naming the task a sandbox was made for (optional)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NetworkPolicy(_Model):
    mode: NetworkMode = "none"
    allowed_hosts: tuple[str, ...] = ()


class Resources(_Model):
    cpus: float | None = Field(None, gt=0)
    memory_mb: int | None = Field(None, gt=0)
    disk_mb: int | None = Field(None, gt=0)
    gpus: int = Field(0, ge=0)


class BuildContext(_Model):
    """A Docker build: ``context_dir`` holding ``dockerfile``."""

    context_dir: Path
    dockerfile: str = "Dockerfile"


ServiceCondition = Literal["service_started", "service_healthy", "service_completed_successfully"]


class VolumeMount(_Model):
    """A Docker Compose volume of a sandbox's containers. ``source``: a volume name (created for
    the sandbox, shared by each of its containers that mounts the name, removed with it), an
    absolute host directory (a bind; compose files may bind only directories of their task), or
    '' (an anonymous volume of one container)."""

    source: str = Field(pattern=r"^(|/.*|[a-zA-Z0-9][a-zA-Z0-9_.-]*)$")
    target: str = Field(pattern=r"^/")
    read_only: bool = False

    @property
    def is_bind(self) -> bool:
        return self.source.startswith("/")


class ServiceSpec(_Model):
    """A sidecar container (a Docker Compose service besides the agent's): the sandbox's
    commands reach it by ``name`` on a private network; it is started, and healthy, before
    the sandbox is handed out, and removed with it."""

    name: str = Field(pattern=r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
    image: str | None = None
    build: BuildContext | None = None
    env: Mapping[str, str] = Field(default_factory=dict)
    command: tuple[str, ...] | None = None  # argv; None: the image's own
    healthcheck: tuple[str, ...] | None = None  # argv run inside the service until it exits 0
    ready_timeout_s: float = Field(120.0, gt=0)
    volumes: tuple[VolumeMount, ...] = ()
    depends_on: Mapping[str, ServiceCondition] = Field(default_factory=dict)  # started only once these hold
    # what the agent's container waits for; None: completed when another service waits for its
    # completion, else healthy when it has a healthcheck, else started
    main_waits_for: ServiceCondition | None = None
    resources: Resources = Field(default_factory=Resources)  # its cpus / memory_mb limits (compose)
    pids_limit: int | None = Field(None, gt=0)  # at most the backend's own pids limit


class SandboxSpec(_Model):
    """What a task asks of a sandbox.

    ``image``/``build`` ask for a container image; ``None`` for both means "the backend's
    default userland" (for the local backend: the host's toolchain). ``paths`` lists the
    absolute directories the task expects to exist and be writable (e.g. ``/app``,
    ``/logs``); ``workdir`` is the directory commands start in.
    """

    image: str | None = None
    build: BuildContext | None = None
    workdir: str = "/app"
    paths: tuple[str, ...] = ("/app", "/logs", "/tests", "/solution")
    env: Mapping[str, str] = Field(default_factory=dict)
    resources: Resources = Field(default_factory=Resources)
    network: NetworkPolicy = Field(default_factory=NetworkPolicy)
    ttl_s: float | None = Field(None, gt=0)
    labels: Mapping[str, str] = Field(default_factory=dict)
    files: Mapping[str, bytes] = Field(default_factory=dict)
    user: str | None = None
    min_isolation: IsolationLevel = "process"
    services: tuple[ServiceSpec, ...] = ()  # sidecars (compose services), backends with Capabilities.services
    volumes: tuple[VolumeMount, ...] = ()  # compose volumes of the agent's container (same backends)
    # start the container as its image defines it: the image's ENTRYPOINT runs (e.g. starts a
    # server) with the backend's keep-alive as its arguments (Harbor's ``command: sleep infinity``);
    # False: the backend replaces the ENTRYPOINT with its keep-alive
    keep_entrypoint: bool = False


class Capabilities(_Model):
    """What a backend can honestly provide."""

    isolation: IsolationLevel
    network_modes: frozenset[NetworkMode] = frozenset({"public"})
    images: bool = False
    dockerfile_build: bool = False
    absolute_paths: bool = False
    run_as_user: bool = False
    gpus: bool = False
    max_cpus: float | None = None
    max_memory_mb: int | None = None
    services: bool = False  # sidecar containers (SandboxSpec.services)
    keep_entrypoint: bool = False  # runs the image's ENTRYPOINT (SandboxSpec.keep_entrypoint)


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0
    isolation: IsolationLevel | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class Sandbox(Protocol):
    """One live sandbox. Use as ``async with await backend.create(spec) as sb: ...``."""

    id: str
    isolation: IsolationLevel

    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
        max_output_bytes: int | None = None,
        user: str | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (a string runs under ``bash -c``; a list runs as argv)."""
        ...

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None: ...

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes: ...

    async def upload_dir(self, local: Path, remote: str) -> None: ...

    async def download_dir(self, remote: str, local: Path) -> None: ...

    async def alive(self) -> bool: ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> Sandbox: ...

    async def __aexit__(self, *exc: object) -> None: ...


@runtime_checkable
class SandboxBackend(Protocol):
    name: str

    def capabilities(self) -> Capabilities: ...

    async def create(self, spec: SandboxSpec) -> Sandbox:
        """Create a sandbox; must call :func:`check_supported` first."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class SweepableBackend(Protocol):
    """A backend whose sandboxes live outside this process (a Docker engine, a cloud).

    ``sweep`` removes every sandbox labelled ``RUN_LABEL=run_id`` (running or stopped) and
    returns the ids it removed. It is idempotent (a second call returns ``[]``) and safe to
    run while another process of that run is still alive (its sandboxes are then gone).
    """

    name: str

    async def sweep(self, run_id: str) -> list[str]: ...


@dataclass(frozen=True)
class UnmetNeed:
    """One thing a spec asks that a backend cannot give: ``field`` says which (``gpus``,
    ``image``, ``build``, ``network``, ``paths``, ``isolation``, ``services``, ``volumes``,
    ``user``, ``cpus``, ``memory``, ``entrypoint``), ``text`` says it to a person, ``detail`` the level asked
    (an isolation level or network mode) where the remedy depends on it."""

    field: str
    text: str
    detail: str = ""


def unmet_spec_needs(spec: SandboxSpec, caps: Capabilities) -> list[UnmetNeed]:
    """Every need of ``spec`` that ``caps`` cannot meet."""
    needs: list[UnmetNeed] = []
    if ISOLATION_ORDER.index(caps.isolation) < ISOLATION_ORDER.index(spec.min_isolation):
        needs.append(UnmetNeed("isolation", f"isolation '{spec.min_isolation}' (backend achieves "
                                            f"'{caps.isolation}')", spec.min_isolation))
    if spec.image and not caps.images:
        needs.append(UnmetNeed("image", f"container image '{spec.image}'"))
    if spec.build and not caps.dockerfile_build:
        needs.append(UnmetNeed("build", f"a Docker build of {spec.build.context_dir / spec.build.dockerfile}"))
    if spec.network.mode not in caps.network_modes:
        needs.append(UnmetNeed("network", f"network '{spec.network.mode}' (supported: "
                                          f"{', '.join(sorted(caps.network_modes))})", spec.network.mode))
    if spec.paths and not caps.absolute_paths:
        needs.append(UnmetNeed("paths", f"absolute task paths {', '.join(spec.paths)} (needs a private mount "
                                        f"namespace)"))
    if spec.resources.gpus and not caps.gpus:
        needs.append(UnmetNeed("gpus", f"{spec.resources.gpus} GPU(s)"))
    if spec.services and not caps.services:
        needs.append(UnmetNeed("services", f"sidecar services {', '.join(sv.name for sv in spec.services)} "
                                           f"(Docker Compose)"))
    if spec.volumes and not caps.services:
        needs.append(UnmetNeed("volumes", f"volumes {', '.join(v.target for v in spec.volumes)} (Docker Compose)"))
    if spec.keep_entrypoint and not caps.keep_entrypoint:
        needs.append(UnmetNeed("entrypoint", "the image's ENTRYPOINT running as the container's main process "
                                             "(this backend replaces it)"))
    if spec.user and not caps.run_as_user:
        needs.append(UnmetNeed("user", f"running as user '{spec.user}'"))
    if caps.max_cpus and spec.resources.cpus and spec.resources.cpus > caps.max_cpus:
        needs.append(UnmetNeed("cpus", f"{spec.resources.cpus} CPUs (max {caps.max_cpus})"))
    if caps.max_memory_mb and spec.resources.memory_mb and spec.resources.memory_mb > caps.max_memory_mb:
        needs.append(UnmetNeed("memory", f"{spec.resources.memory_mb} MB memory (max {caps.max_memory_mb})"))
    for sv in spec.services:
        if caps.max_cpus and sv.resources.cpus and sv.resources.cpus > caps.max_cpus:
            needs.append(UnmetNeed("cpus", f"{sv.resources.cpus} CPUs for service '{sv.name}' (max {caps.max_cpus})"))
        if caps.max_memory_mb and sv.resources.memory_mb and sv.resources.memory_mb > caps.max_memory_mb:
            needs.append(UnmetNeed("memory", f"{sv.resources.memory_mb} MB memory for service '{sv.name}' "
                                             f"(max {caps.max_memory_mb})"))
    return needs


def unmet_needs(spec: SandboxSpec, caps: Capabilities) -> list[str]:
    return [need.text for need in unmet_spec_needs(spec, caps)]


# Who provides a need, for the remedy of a refusal: (backend, how; "" when it needs no setting).
# The backend in use is never offered as its own remedy; a setting of it that would help is.
_CONTAINER_BACKENDS = (("docker", ""), ("daytona", ""), ("e2b", ""), ("modal", ""))
_ISOLATION_OF = {"local": "namespace", "docker": "container", "daytona": "container", "modal": "container",
                 "e2b": "microvm"}
_PROVIDERS: dict[str, tuple[tuple[str, str], ...]] = {
    "sandbox": (("local", ""), *_CONTAINER_BACKENDS),
    "image": _CONTAINER_BACKENDS,
    "build": _CONTAINER_BACKENDS,
    "paths": (("local", "where the kernel allows user namespaces (bubblewrap or unshare)"), *_CONTAINER_BACKENDS),
    "gpus": (("docker", "sandbox option gpus=true, on a host with NVIDIA GPUs"),
             ("modal", "sandbox option gpu=<type>")),
    "services": (("docker", ""),),
    "volumes": (("docker", ""),),
    "user": (("docker", ""),),
    "entrypoint": (("docker", ""),),
    "cpus": (("docker", "sandbox option max_cpus raised or unset"),),
    "memory": (("docker", "sandbox option max_memory_mb raised or unset"),),
}
_NETWORK_PROVIDERS: dict[str, tuple[tuple[str, str], ...]] = {
    "none": (("local", "where the kernel allows user namespaces"), ("docker", ""), ("daytona", ""), ("e2b", ""),
             ("modal", "")),
    "allowlist": (("daytona", ""), ("e2b", ""), ("modal", "")),
    "public": (("local", ""), *_CONTAINER_BACKENDS),
}


def _providers(need: UnmetNeed) -> tuple[tuple[str, str], ...]:
    if need.field == "isolation":
        wanted = ISOLATION_ORDER.index(need.detail) if need.detail in ISOLATION_ORDER else 0
        return tuple((b, "") for b, level in _ISOLATION_OF.items() if ISOLATION_ORDER.index(level) >= wanted)
    if need.field == "network":
        return _NETWORK_PROVIDERS.get(need.detail, ())
    return _PROVIDERS.get(need.field, ())


def remedy(needs: Sequence[UnmetNeed], backend: str | None) -> str:
    """What would run a spec with ``needs``: backends that provide every one of them (never
    ``backend``, the one in use), and a setting of ``backend`` that would, where there is one."""
    if not needs:
        return ""
    others: list[str] | None = None
    here: list[str] = []
    for need in needs:
        providers = _providers(need)
        names = [b for b, _ in providers if b != backend]
        others = names if others is None else [b for b in others if b in names]
        here.extend(how for b, how in providers if b == backend and how)
    hows = {b: how for need in needs for b, how in _providers(need) if how}
    parts = [", ".join(f"{b} ({hows[b]})" if b in hows else b for b in others or ())]
    text = f"a sandbox backend that provides it: {parts[0]}" if others else ""
    if here:
        text += (" or, " if text else "") + "on this backend, " + "; ".join(dict.fromkeys(here))
    return text or "no known sandbox backend provides it"


def check_supported(spec: SandboxSpec, caps: Capabilities, *, backend: str, task: str | None = None) -> None:
    """Raise :class:`SandboxUnsupportedError` naming every need ``caps`` cannot meet and what would run it."""
    needs = unmet_spec_needs(spec, caps)
    task = task or spec.labels.get(TASK_LABEL)
    if needs:
        who = f"task '{task}'" if task else "the sandbox spec"
        raise SandboxUnsupportedError(
            f"sandbox backend '{backend}' cannot run {who}: it needs {'; '.join(n.text for n in needs)}. "
            f"What would run it: {remedy(needs, backend)} (a task is refused, never run under-isolated)."
        )

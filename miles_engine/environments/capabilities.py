"""What an environment needs (its capabilities manifest) and the check against a sandbox backend.

Every environment source declares an :class:`EnvironmentCapabilities` through an optional
``capabilities()`` method: the widest needs over all of its tasks. A source without one gets a
manifest derived from its first task (:func:`derive_capabilities`). :func:`check_environment`
refuses a backend that cannot meet the whole manifest (the contract suite and authors' checks use
it). The programs that run tasks (``miles env``, ``miles eval``, training) decide per task instead
(:mod:`miles_engine.environments.admission`): one task asking for a GPU leaves that task out, not
its set. The per-task :func:`~miles_engine.sandbox.protocol.check_supported` at sandbox creation
still guards each task's exact spec. A refusal names what would run the task, never the backend
in use (:func:`~miles_engine.sandbox.protocol.remedy`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from miles_engine.environments.protocol import EnvironmentSource, Task
from miles_engine.errors import ConfigError, SandboxUnsupportedError
from miles_engine.sandbox.protocol import ISOLATION_ORDER, Capabilities, IsolationLevel, NetworkMode, UnmetNeed, remedy

# how much network a mode exposes; the manifest records the widest mode any task asks for
NETWORK_ORDER: tuple[NetworkMode, ...] = ("none", "allowlist", "public")


class EnvironmentCapabilities(BaseModel):
    """An environment's needs: the maximum over its tasks.

    ``network`` is the sandbox's network (what commands inside it may reach); ``services`` are
    endpoints the environment itself calls from the host (e.g. a NeMo Gym resources server),
    which need no sandbox network.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    needs_sandbox: bool = Field(True, description="tasks run commands in a sandbox")
    image: bool = Field(False, description="some task names a container image")
    dockerfile_build: bool = Field(False, description="some task builds its image from a Dockerfile")
    network: NetworkMode = Field("none", description="widest sandbox network any task asks for")
    absolute_paths: bool = Field(False, description="tasks expect absolute paths such as /app to exist")
    min_isolation: IsolationLevel = Field("process", description="strongest isolation any task asks for")
    gpus: int = Field(0, ge=0, description="most GPUs any task's sandbox asks for")
    run_as_user: bool = Field(False, description="some task runs commands as a named user")
    multi_turn: bool = Field(True, description="episodes take more than one agent turn")
    tools: tuple[str, ...] = Field((), description="names of the tools offered to the agent")
    reference_solution: bool = Field(False, description="tasks ship a reference solution (the oracle agent)")
    services: tuple[str, ...] = Field((), description="endpoints the environment calls from the host")

    @model_validator(mode="after")
    def _consistent(self) -> EnvironmentCapabilities:
        if not self.needs_sandbox:
            claimed = [name for name, on in (
                ("image", self.image), ("dockerfile_build", self.dockerfile_build),
                ("network", self.network != "none"), ("absolute_paths", self.absolute_paths),
                ("gpus", self.gpus > 0), ("run_as_user", self.run_as_user),
                ("min_isolation", self.min_isolation != "process")) if on]
            if claimed:
                raise ValueError(f"needs_sandbox=False contradicts sandbox needs: {', '.join(claimed)}")
        if len(set(self.tools)) != len(self.tools):
            raise ValueError(f"tools lists a name twice: {list(self.tools)}")
        return self

    def describe(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _widest(modes: Iterable[NetworkMode]) -> NetworkMode:
    return max(modes, key=NETWORK_ORDER.index, default="none")


def capabilities_of_tasks(tasks: Iterable[Task], *, reference_solution: bool = False,
                          services: Iterable[str] = ()) -> EnvironmentCapabilities:
    """The manifest covering ``tasks`` (union of their sandbox specs, tools and turn limits)."""
    specs, tools, multi_turn, any_task = [], [], False, False
    for task in tasks:
        any_task = True
        spec = task.sandbox_spec()
        if spec is not None:
            specs.append(spec)
        tools.extend(t.name for t in task.tools())
        multi_turn = multi_turn or task.limits.max_turns > 1
    return EnvironmentCapabilities(
        needs_sandbox=bool(specs),
        image=any(s.image for s in specs),
        dockerfile_build=any(s.build is not None for s in specs),
        network=_widest(s.network.mode for s in specs),
        absolute_paths=any(bool(s.paths) for s in specs),
        min_isolation=max((s.min_isolation for s in specs), key=ISOLATION_ORDER.index, default="process"),
        gpus=max((s.resources.gpus for s in specs), default=0),
        run_as_user=any(s.user for s in specs),
        multi_turn=multi_turn if any_task else True,
        tools=tuple(dict.fromkeys(tools)),
        reference_solution=reference_solution,
        services=tuple(services),
    )


def derive_capabilities(source: EnvironmentSource) -> EnvironmentCapabilities:
    """A default manifest for a source that declares none: read from its first listed task."""
    first = next(iter(source.list_tasks()), None)
    if first is None:
        return EnvironmentCapabilities()
    return capabilities_of_tasks([source.load_task(first.id)])


def environment_capabilities(source: EnvironmentSource) -> EnvironmentCapabilities:
    """The source's declared manifest (``source.capabilities()``), or one derived from its first task."""
    declare = getattr(source, "capabilities", None)
    if declare is None:
        return derive_capabilities(source)
    name = getattr(source, "name", type(source).__name__)
    try:
        caps = declare()
        if isinstance(caps, dict):
            caps = EnvironmentCapabilities.model_validate(caps)
    except ValidationError as exc:
        raise ConfigError(f"environment '{name}' declares invalid capabilities: {exc}") from exc
    if not isinstance(caps, EnvironmentCapabilities):
        raise ConfigError(f"environment '{name}': capabilities() returned {type(caps).__name__}, "
                          f"expected EnvironmentCapabilities")
    return caps


def environment_needs_unmet(caps: EnvironmentCapabilities, backend: Capabilities | None) -> list[UnmetNeed]:
    """Every need in ``caps`` the backend (``None``: no sandbox backend at all) cannot meet."""
    if not caps.needs_sandbox:
        return []
    if backend is None:
        return [UnmetNeed("sandbox", "a sandbox (none configured)")]
    needs: list[UnmetNeed] = []
    if ISOLATION_ORDER.index(backend.isolation) < ISOLATION_ORDER.index(caps.min_isolation):
        needs.append(UnmetNeed("isolation", f"isolation '{caps.min_isolation}' (backend achieves "
                                            f"'{backend.isolation}')", caps.min_isolation))
    if caps.network not in backend.network_modes:
        needs.append(UnmetNeed("network", f"network '{caps.network}' (backend supports: "
                                          f"{', '.join(sorted(backend.network_modes))})", caps.network))
    if caps.image and not backend.images:
        needs.append(UnmetNeed("image", "container images"))
    if caps.dockerfile_build and not backend.dockerfile_build:
        needs.append(UnmetNeed("build", "Dockerfile builds"))
    if caps.absolute_paths and not backend.absolute_paths:
        needs.append(UnmetNeed("paths", "absolute task paths such as /app (needs a private mount namespace)"))
    if caps.gpus and not backend.gpus:
        needs.append(UnmetNeed("gpus", f"{caps.gpus} GPU(s)"))
    if caps.run_as_user and not backend.run_as_user:
        needs.append(UnmetNeed("user", "running commands as a named user"))
    return needs


def unmet_environment_needs(caps: EnvironmentCapabilities, backend: Capabilities | None) -> list[str]:
    return [need.text for need in environment_needs_unmet(caps, backend)]


def check_environment(env: str, caps: EnvironmentCapabilities, backend: str | None,
                      backend_caps: Capabilities | None) -> None:
    """Refuse, before any episode starts, a backend that cannot meet the environment's needs."""
    needs = environment_needs_unmet(caps, backend_caps)
    if needs:
        who = f"sandbox backend '{backend}'" if backend else "no sandbox backend"
        raise SandboxUnsupportedError(
            f"environment '{env}' cannot run on {who}: it needs {'; '.join(n.text for n in needs)}. "
            f"What would run it: {remedy(needs, backend)} (tasks are refused, never run under-isolated)."
        )


def preflight(source: EnvironmentSource, backend_name: str | None, backend: Any | None) -> EnvironmentCapabilities:
    """Resolve the source's manifest and check it against ``backend`` (a SandboxBackend or None)."""
    caps = environment_capabilities(source)
    name = getattr(source, "name", type(source).__name__)
    check_environment(name, caps, backend_name, backend.capabilities() if backend is not None else None)
    return caps


async def close_environment(source: EnvironmentSource) -> None:
    """Release what a source holds (e.g. a server it started): its optional ``aclose()``."""
    close = getattr(source, "aclose", None)
    if close is not None:
        await close()


def demonstrations(source: Any, n: int, seed: int, wrong_fraction: float | None = None) -> list[Any]:
    """``n`` fresh demonstrations of an environment that makes them (the SFT warm start's data and
    a tiny policy's tokenizer corpus); one error naming the fix when it makes none."""
    make = getattr(source, "demonstrations", None)
    if make is None:
        raise ConfigError(f"environment '{getattr(source, 'name', source)}' provides no demonstrations: set "
                          f"tokenizer.path (a trained tokenizer) and sft.enabled=false, or pick an environment "
                          f"with demonstrations (e.g. shell-drills)")
    return list(make(n, seed=seed, wrong_fraction=wrong_fraction))

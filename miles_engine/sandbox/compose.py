"""Docker Compose services as sandbox sidecars: the part of a compose file the engine runs.

Both terminal-bench (``docker-compose.yaml``; the agent's container is ``client``) and Harbor
(``environment/docker-compose.yaml`` overlays; the agent's container is ``main``) describe
extra services this way. :func:`load_sidecars` turns every service but the agent's into a
:class:`~miles_engine.sandbox.protocol.ServiceSpec` (image or build, environment, command,
healthcheck). ``${VAR}`` / ``${VAR:-default}`` / ``$VAR`` are filled from ``variables``; an
unknown one without default is an error naming it (``strict``) or empty, as compose does;
``$$`` is a literal ``$``.
``depends_on`` orders the services (``service_started`` / ``service_healthy`` /
``service_completed_successfully``) and the agent's own ``depends_on`` says what its container
waits for. ``volumes``: named volumes (one per sandbox, shared by the containers that mount
the name), anonymous ones, and binds of directories inside the compose file's own directory
(the task's); a bind of any other host path is refused (a task must not reach the host). The
agent's binds are host-side log mounts in both benchmarks and are left out (the sandbox has its
own /logs). Per-service limits (``cpus``, ``mem_limit``, ``pids_limit``, ``deploy.resources.limits``)
go onto the service's container, the agent's own onto ``main_limits``; ``ports`` / ``expose`` are
checked and not published (see :mod:`miles_engine.sandbox.compose_limits`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from miles_engine.errors import TaskFormatError
from miles_engine.sandbox.compose_limits import ServiceLimits, check_ports, service_limits
from miles_engine.sandbox.protocol import BuildContext, ServiceSpec, VolumeMount

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def read_compose(path: Path) -> dict[str, Any]:
    """The compose file's ``services`` mapping (an error naming the file when malformed)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise TaskFormatError(f"{path}: cannot read docker-compose file: {exc}") from exc
    services = data.get("services") if isinstance(data, dict) else None
    if not isinstance(services, dict):
        raise TaskFormatError(f"{path}: field 'services' must be a mapping of service names")
    return services


def fill(value: Any, variables: Mapping[str, str], where: str, *, strict: bool = True) -> str:
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":  # compose's escape for a literal $
            return "$"
        name = m.group(1) or m.group(3)
        if name in variables:
            return variables[name]
        if m.group(2) is not None:
            return m.group(2)
        if not strict:
            return ""
        raise TaskFormatError(f"{where}: variable ${{{name}}} is not set and has no default")

    return _VAR.sub(sub, str(value))


def environment(raw: Any, variables: Mapping[str, str], where: str, *, strict: bool = True) -> dict[str, str]:
    """A service's ``environment`` (list of KEY=VALUE or mapping), filled."""
    raw = raw or {}
    if isinstance(raw, list):
        raw = {k: v for k, _, v in (str(item).partition("=") for item in raw)}
    if not isinstance(raw, dict):
        raise TaskFormatError(f"{where}.environment: must be a list of KEY=VALUE or a mapping")
    return {str(k): fill("" if v is None else v, variables, f"{where}.environment.{k}", strict=strict)
            for k, v in raw.items()}


def argv(value: Any, variables: Mapping[str, str], where: str, *, strict: bool = True) -> tuple[str, ...]:
    """A compose command / healthcheck test as argv (``CMD``, ``CMD-SHELL`` or a shell string)."""
    if isinstance(value, str):
        return ("/bin/sh", "-c", fill(value, variables, where, strict=strict))
    if not isinstance(value, list) or not value:
        raise TaskFormatError(f"{where}: must be a string or a non-empty list")
    items = [fill(v, variables, where, strict=strict) for v in value]
    if items[0] == "CMD-SHELL":
        return ("/bin/sh", "-c", " ".join(items[1:]))
    if items[0] == "CMD":
        return tuple(items[1:])
    return tuple(items)


CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")


@dataclass(frozen=True)
class ComposeServices:
    """What a compose file adds to the agent's sandbox: its sidecars and the agent's volumes."""

    sidecars: tuple[ServiceSpec, ...]
    main_volumes: tuple[VolumeMount, ...]
    main_limits: ServiceLimits  # what the agent's service asks (the task's own config wins)
    main_env: dict[str, str] = field(default_factory=dict)  # the agent's service's environment (task env wins)


def depends_on(raw: Any, where: str) -> dict[str, str]:
    """``depends_on`` as {service: condition} (a list means ``service_started`` for each)."""
    if raw is None:
        return {}
    if isinstance(raw, list):
        return {str(name): "service_started" for name in raw}
    if not isinstance(raw, dict):
        raise TaskFormatError(f"{where}.depends_on: must be a list of services or a mapping")
    out = {}
    for name, opts in raw.items():
        cond = (opts or {}).get("condition", "service_started") if isinstance(opts, dict) else None
        if cond not in CONDITIONS:
            raise TaskFormatError(f"{where}.depends_on.{name}.condition: {cond!r} is not one of {', '.join(CONDITIONS)}")
        out[str(name)] = cond
    return out


def volumes(raw: Any, variables: Mapping[str, str], where: str, *, base: Path, binds: bool,
            strict: bool = True) -> tuple[VolumeMount, ...]:
    """A service's ``volumes`` (short ``SRC:DST[:ro]`` or long form). Binds resolve against
    ``base`` and must stay inside it; ``binds=False`` leaves binds out."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise TaskFormatError(f"{where}.volumes: must be a list")
    out = []
    for i, item in enumerate(raw):
        at = f"{where}.volumes[{i}]"
        if isinstance(item, str):
            parts = fill(item, variables, at, strict=strict).split(":")
            if len(parts) == 1:
                source, target, mode = "", parts[0], ""
            elif len(parts) in (2, 3):
                source, target, mode = parts[0], parts[1], parts[2] if len(parts) == 3 else ""
            else:
                raise TaskFormatError(f"{at}: {item!r} is not SOURCE:TARGET[:MODE]")
            read_only = "ro" in mode.split(",")
        elif isinstance(item, dict):
            kind = item.get("type", "volume")
            if kind not in ("volume", "bind"):
                raise TaskFormatError(f"{at}.type: {kind!r} is not supported (volume or bind)")
            source = fill(item.get("source", ""), variables, f"{at}.source", strict=strict)
            target = fill(item.get("target", ""), variables, f"{at}.target", strict=strict)
            read_only = bool(item.get("read_only", False))
            if kind == "bind" and not source.startswith((".", "/", "~")):
                source = "./" + source
        else:
            raise TaskFormatError(f"{at}: must be a string or a mapping")
        if not target.startswith("/"):
            raise TaskFormatError(f"{at}: target {target!r} must be an absolute path in the container")
        if source.startswith((".", "/", "~")):  # a bind of a host path
            if not binds:
                continue
            host = (base / Path(source).expanduser()).resolve()
            if host != base.resolve() and base.resolve() not in host.parents:
                raise TaskFormatError(f"{at}: bind of '{source}' is outside the task's directory '{base}' "
                                      "(only the task's own files may be mounted)")
            if not host.exists():
                raise TaskFormatError(f"{at}: bind source '{host}' does not exist")
            source = str(host)
        elif source and not re.fullmatch(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*", source):
            raise TaskFormatError(f"{at}: volume name {source!r} is not valid")
        out.append(VolumeMount(source=source, target=target, read_only=read_only))
    return tuple(out)


def _check_order(sidecars: list[ServiceSpec], path: Path) -> None:
    """Every depends_on names a sidecar, service_healthy ones have a healthcheck, no cycles."""
    by_name = {s.name: s for s in sidecars}
    for svc in sidecars:
        if svc.main_waits_for == "service_healthy" and svc.healthcheck is None:
            raise TaskFormatError(f"{path}: the agent's container depends on '{svc.name}' being service_healthy "
                                  f"but '{svc.name}' has no healthcheck")
        for dep, cond in svc.depends_on.items():
            if dep not in by_name:
                raise TaskFormatError(f"{path} services.{svc.name}.depends_on: no service '{dep}' "
                                      f"(services: {', '.join(sorted(by_name))})")
            if cond == "service_healthy" and by_name[dep].healthcheck is None:
                raise TaskFormatError(f"{path} services.{svc.name}.depends_on.{dep}: service_healthy but "
                                      f"'{dep}' has no healthcheck")
    start_order(sidecars, where=str(path))


def start_order(services: Any, *, where: str) -> list[ServiceSpec]:
    """The services with each after everything it depends on (a cycle is an error naming it)."""
    by_name = {s.name: s for s in services}
    done: dict[str, bool] = {}  # False: on the current path
    order: list[ServiceSpec] = []

    def visit(name: str, path: list[str]) -> None:
        if done.get(name) is True:
            return
        if name in done:
            raise TaskFormatError(f"{where}: depends_on cycle {' -> '.join([*path, name])}")
        done[name] = False
        for dep in by_name[name].depends_on:
            if dep in by_name:
                visit(dep, [*path, name])
        done[name] = True
        order.append(by_name[name])

    for name in by_name:
        visit(name, [])
    return order


def load_sidecars(path: Path, *, main: str, variables: Mapping[str, str] | None = None,
                  strict: bool = True) -> tuple[ServiceSpec, ...]:
    """Every service of ``path`` except ``main`` (the agent's container), as sidecar specs."""
    return load_services(path, main=main, variables=variables, strict=strict).sidecars


def load_services(path: Path, *, main: str, variables: Mapping[str, str] | None = None,
                  strict: bool = True) -> ComposeServices:
    """The sidecars of ``path`` (every service but ``main``, the agent's container, which waits
    for what its ``depends_on`` says), the named volumes ``main`` mounts, its limits and environment."""
    variables = variables or {}
    services = read_compose(path)
    main_raw = services.get(main) or {}
    if not isinstance(main_raw, dict):
        raise TaskFormatError(f"{path} services.{main}: must be a mapping")
    main_waits = depends_on(main_raw.get("depends_on"), f"{path} services.{main}")
    main_volumes = volumes(main_raw.get("volumes"), variables, f"{path} services.{main}", base=path.parent,
                           binds=False, strict=strict)
    main_limits = service_limits(main_raw, f"{path} services.{main}")
    main_env = environment(main_raw.get("environment"), variables, f"{path} services.{main}", strict=strict)
    check_ports(main_raw, f"{path} services.{main}", path=path, service=main, main=True)
    out = []
    for name, raw in services.items():
        if name == main:
            continue
        where = f"{path} services.{name}"
        raw = raw or {}
        if not isinstance(raw, dict):
            raise TaskFormatError(f"{where}: must be a mapping")
        image, build = raw.get("image"), None
        if raw.get("build") is not None:
            b = raw["build"] if isinstance(raw["build"], dict) else {"context": raw["build"]}
            context = (path.parent / fill(b.get("context", "."), variables, f"{where}.build.context", strict=strict))
            context = context.resolve()
            if not context.is_dir():
                raise TaskFormatError(f"{where}.build.context: '{context}' is not a directory")
            dockerfile = fill(b.get("dockerfile", "Dockerfile"), variables, f"{where}.build.dockerfile", strict=strict)
            build, image = BuildContext(context_dir=context, dockerfile=dockerfile), None
        elif not image:
            raise TaskFormatError(f"{where}: needs 'build' or 'image'")
        limits = service_limits(raw, where)
        check_ports(raw, where, path=path, service=str(name))
        health = raw.get("healthcheck") or {}
        test = health.get("test") if isinstance(health, dict) else None
        out.append(ServiceSpec(
            name=str(name),
            image=fill(image, variables, f"{where}.image", strict=strict) if image else None,
            build=build,
            env=environment(raw.get("environment"), variables, where, strict=strict),
            command=argv(raw["command"], variables, f"{where}.command", strict=strict) if raw.get("command") else None,
            healthcheck=None if test in (None, ["NONE"]) else argv(test, variables, f"{where}.healthcheck.test",
                                                                   strict=strict),
            volumes=volumes(raw.get("volumes"), variables, where, base=path.parent, binds=True, strict=strict),
            depends_on={k: v for k, v in depends_on(raw.get("depends_on"), where).items() if k != main},
            main_waits_for=main_waits.get(str(name)),
            resources=limits.resources,
            pids_limit=limits.pids_limit,
        ))
    unknown = sorted(set(main_waits) - {s.name for s in out})
    if unknown:
        raise TaskFormatError(f"{path} services.{main}.depends_on: no service {', '.join(map(repr, unknown))}")
    _check_order(out, path)
    return ComposeServices(tuple(out), main_volumes, main_limits, main_env)

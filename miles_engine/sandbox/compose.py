"""Docker Compose services as sandbox sidecars: the part of a compose file the engine runs.

Both terminal-bench (``docker-compose.yaml``; the agent's container is ``client``) and Harbor
(``environment/docker-compose.yaml`` overlays; the agent's container is ``main``) describe
extra services this way. :func:`load_sidecars` turns every service but the agent's into a
:class:`~miles_engine.sandbox.protocol.ServiceSpec` (image or build, environment, command,
healthcheck). ``${VAR}`` / ``${VAR:-default}`` / ``$VAR`` are filled from ``variables``; an
unknown one without default is an error naming it (``strict``) or empty, as compose does;
``$$`` is a literal ``$``.
Volumes, ports, depends_on ordering and per-service resources are not carried over.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from miles_engine.errors import TaskFormatError
from miles_engine.sandbox.protocol import BuildContext, ServiceSpec

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


def load_sidecars(path: Path, *, main: str, variables: Mapping[str, str] | None = None,
                  strict: bool = True) -> tuple[ServiceSpec, ...]:
    """Every service of ``path`` except ``main`` (the agent's container), as sidecar specs."""
    variables = variables or {}
    out = []
    for name, raw in read_compose(path).items():
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
        ))
    return tuple(out)

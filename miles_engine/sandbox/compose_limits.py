"""A compose service's resource limits and ports, as the sandbox engine takes them.

Limits: ``cpus``, ``mem_limit`` and ``pids_limit``, or their ``deploy.resources.limits`` forms
(``cpus``, ``memory``, ``pids``); the same limit given both ways with different values is an
error, as in ``docker compose``. Reservations (``deploy.resources.reservations``,
``mem_reservation``) are not limits and are left out.

Ports: a sidecar is reached by its name on the sandbox's private network, on the port it
listens on, so nothing is published on the host (a published port would expose a task's
service to the host's network). ``ports`` and ``expose`` are checked (a bad entry is an error
naming the service, key and file) and then left out, with one log line per service saying so.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_engine.errors import TaskFormatError
from miles_engine.sandbox.protocol import Resources

log = logging.getLogger(__name__)

_BYTES = re.compile(r"^(\d+(?:\.\d+)?) ?([kmgt])?i?b?$", re.IGNORECASE)
_UNIT = {None: 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
MIN_MEMORY_MB = 6  # the engine refuses a smaller memory limit
_PORT = r"\d{1,5}(?:-\d{1,5})?"
_SHORT_PORT = re.compile(rf"^(?:(?:\[[0-9a-fA-F:.]+\]|[0-9.]+):)?(?:(?:{_PORT})?:)?({_PORT})(?:/(tcp|udp|sctp))?$")
_logged: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class ServiceLimits:
    """What a service's compose keys ask of its container."""

    resources: Resources
    pids_limit: int | None  # None: the backend's own limit


def memory_mb(value: Any, where: str) -> int:
    """A compose byte value (``512m``, ``1.5g``, ``1073741824``) in MiB, rounded up."""
    if isinstance(value, bool):
        raise TaskFormatError(f"{where}: {value!r} is not a size (e.g. 512m, 2g, or bytes)")
    if isinstance(value, (int, float)):
        amount = float(value)
    else:
        m = _BYTES.match(str(value).strip())
        if not m:
            raise TaskFormatError(f"{where}: {value!r} is not a size (e.g. 512m, 2g, or bytes)")
        amount = float(m.group(1)) * _UNIT[m.group(2).lower() if m.group(2) else None]
    mb = math.ceil(amount / (1 << 20))
    if mb < MIN_MEMORY_MB:
        raise TaskFormatError(f"{where}: {value!r} is below the engine's minimum memory limit of {MIN_MEMORY_MB}m")
    return mb


def cpus(value: Any, where: str) -> float:
    try:
        out = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        out = math.nan
    if not out > 0 or math.isinf(out):
        raise TaskFormatError(f"{where}: {value!r} is not a positive number of CPUs (e.g. 0.5, 2)")
    return out


def pids(value: Any, where: str) -> int | None:
    """A pids limit; 0 and -1 mean none (compose's 'unlimited')."""
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not re.fullmatch(r"-?\d+", str(value).strip()):
        raise TaskFormatError(f"{where}: {value!r} is not a whole number of processes")
    n = int(value)
    if n < -1:
        raise TaskFormatError(f"{where}: {value!r} is not a whole number of processes (-1 or 0: no limit)")
    return n if n > 0 else None


def _one(raw: dict[str, Any], limits: dict[str, Any], key: str, deploy_key: str, parse: Any, where: str) -> Any:
    top = parse(raw[key], f"{where}.{key}") if raw.get(key) is not None else None
    deep = parse(limits[deploy_key], f"{where}.deploy.resources.limits.{deploy_key}") \
        if limits.get(deploy_key) is not None else None
    if top is not None and deep is not None and top != deep:
        raise TaskFormatError(f"{where}: '{key}' ({raw[key]!r}) and 'deploy.resources.limits.{deploy_key}' "
                              f"({limits[deploy_key]!r}) differ; give one")
    return top if top is not None else deep


def service_limits(raw: dict[str, Any], where: str) -> ServiceLimits:
    """The limits of one compose service (``raw``: its mapping; ``where``: 'FILE services.NAME')."""
    deploy = raw.get("deploy") or {}
    if not isinstance(deploy, dict):
        raise TaskFormatError(f"{where}.deploy: must be a mapping")
    res = deploy.get("resources") or {}
    if not isinstance(res, dict):
        raise TaskFormatError(f"{where}.deploy.resources: must be a mapping")
    limits = res.get("limits") or {}
    if not isinstance(limits, dict):
        raise TaskFormatError(f"{where}.deploy.resources.limits: must be a mapping")
    return ServiceLimits(
        resources=Resources(cpus=_one(raw, limits, "cpus", "cpus", cpus, where),
                            memory_mb=_one(raw, limits, "mem_limit", "memory", memory_mb, where)),
        pids_limit=_one(raw, limits, "pids_limit", "pids", pids, where),
    )


def check_ports(raw: dict[str, Any], where: str, *, path: Path, service: str, main: bool = False) -> tuple[str, ...]:
    """Validate ``ports`` and ``expose``; return the container ports they name (for the log)."""
    found: list[str] = []
    published: list[str] = []
    for key in ("ports", "expose"):
        items = raw.get(key)
        if items is None:
            continue
        if not isinstance(items, list):
            raise TaskFormatError(f"{where}.{key}: must be a list")
        for i, item in enumerate(items):
            at = f"{where}.{key}[{i}]"
            if isinstance(item, dict) and key == "ports":
                target = item.get("target")
                if isinstance(target, bool) or not isinstance(target, (int, str)) \
                        or not re.fullmatch(_PORT, str(target)):
                    raise TaskFormatError(f"{at}.target: {target!r} is not a container port")
                if item.get("protocol", "tcp") not in ("tcp", "udp", "sctp"):
                    raise TaskFormatError(f"{at}.protocol: {item['protocol']!r} is not one of tcp, udp, sctp")
                port = str(target)
            else:
                form = r"^(" + _PORT + r")(?:/(tcp|udp|sctp))?$" if key == "expose" else _SHORT_PORT.pattern
                m = re.match(form, str(item)) if isinstance(item, (int, str)) and not isinstance(item, bool) else None
                if not m:
                    shape = "PORT[/PROTOCOL]" if key == "expose" else "[[HOST_IP:]HOST_PORT:]CONTAINER_PORT[/PROTOCOL]"
                    raise TaskFormatError(f"{at}: {item!r} is not {shape}")
                port = m.group(1)
            if any(not 0 < int(p) < 65536 for p in port.split("-")):
                raise TaskFormatError(f"{at}: port {port} is out of range (1-65535)")
            found.append(port)
            if key == "ports":
                published.append(port)
    if published and (str(path), service) not in _logged:
        _logged.add((str(path), service))
        if main:
            log.info("%s: ports %s not published on the host (the agent's container is not reachable from "
                     "outside its sandbox)", where, ", ".join(published))
        else:
            log.info("%s: ports %s not published on the host: the sandbox reaches service '%s' by name on its "
                     "private network (%s)", where, ", ".join(published), service,
                     ", ".join(f"{service}:{p}" for p in published))
    return tuple(found)

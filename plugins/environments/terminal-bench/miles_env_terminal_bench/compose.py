"""A terminal-bench ``docker-compose.yaml``: which service is the agent's container, and what it asks.

terminal-bench starts the file with ``docker compose`` after filling the ``T_BENCH_*``
variables, then takes the container named ``$T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME`` as the
agent's: the agent service is the one whose ``container_name`` is that variable, whatever the
service is called (:func:`agent_service`; a file where no service sets it falls back to the
service named ``client``, the name terminal-bench's template gives it). What that service says (its build context and Dockerfile, or its image, its
environment and working directory, its cpus and memory limits) becomes the task's :class:`SandboxSpec`. The variables are
filled as terminal-bench fills them for the paths inside the container; the client's binds of
host-side log paths have no equivalent here and are ignored (its named volumes are kept). The other services become sidecars
(:class:`ServiceSpec`: image or build, environment, command, healthcheck), reachable by name
from the client on a private network, on backends that run them (docker).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from miles_engine.errors import TaskFormatError
from miles_engine.sandbox import compose

CLIENT = "client"
CLIENT_CONTAINER_VAR = "T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME"


def tbench_vars(task_id: str) -> dict[str, str]:
    """The ``T_BENCH_*`` values terminal-bench sets for a task (container-side paths)."""
    name = re.sub(r"[^a-z0-9_.-]", "-", task_id.lower())
    return {
        "T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME": f"tb__{name}__client",
        "T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME": f"tb__{name}__client",
        "T_BENCH_TASK_DOCKER_NAME_PREFIX": f"tb__{name}",
        "T_BENCH_TEST_DIR": "/tests",
        "T_BENCH_CONTAINER_LOGS_PATH": "/logs",
        "T_BENCH_CONTAINER_AGENT_LOGS_PATH": "/agent-logs",
        "T_BENCH_TASK_LOGS_PATH": "/logs",
        "T_BENCH_TASK_AGENT_LOGS_PATH": "/agent-logs",
    }


@dataclass(frozen=True)
class ClientService:
    """What the client service asks of the agent's container."""

    context_dir: Path | None = None  # a build: context and Dockerfile (relative to the context)
    dockerfile: str = "Dockerfile"
    image: str | None = None  # no build: this image
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None


def read_services(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise TaskFormatError(f"{path}: cannot read docker-compose file: {exc}") from exc
    services = data.get("services") if isinstance(data, dict) else None
    if not isinstance(services, dict) or not services:
        raise TaskFormatError(f"{path}: field 'services' must be a mapping of service names")
    return {str(name): spec for name, spec in services.items()}


def agent_service(path: Path, task_id: str) -> str:
    """The agent's service: the one whose ``container_name`` is ``${T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME}``
    (terminal-bench's rule), else the one named ``client``."""
    services = read_services(path)
    variables = tbench_vars(task_id)
    wanted = variables[CLIENT_CONTAINER_VAR]
    named = [name for name, spec in services.items() if isinstance(spec, dict) and spec.get("container_name")
             and compose.fill(spec["container_name"], variables, f"{path} services.{name}.container_name",
                              strict=False) == wanted]
    if len(named) > 1:
        raise TaskFormatError(f"{path}: services {', '.join(named)} all set container_name to "
                              f"${{{CLIENT_CONTAINER_VAR}}}; exactly one is the agent's container")
    if named:
        return named[0]
    if CLIENT in services:
        return CLIENT
    raise TaskFormatError(f"{path}: no service is the agent's container: none sets container_name: "
                          f"${{{CLIENT_CONTAINER_VAR}}} (terminal-bench's rule) and none is named '{CLIENT}' "
                          f"(services: {', '.join(services)})")


def load_client(path: Path, task_id: str, service: str = CLIENT) -> ClientService:
    """Parse ``path`` and return what its agent service ``service`` asks."""
    services = read_services(path)
    if service not in services:
        raise TaskFormatError(f"{path}: needs a 'services' mapping with the '{service}' service (the agent's container)")
    variables = tbench_vars(task_id)
    spec = services[service] or {}
    where = f"{path} services.{service}"
    if not isinstance(spec, dict):
        raise TaskFormatError(f"{where}: must be a mapping")
    env_raw = spec.get("environment") or {}
    if isinstance(env_raw, list):
        pairs = [str(item).partition("=") for item in env_raw]
        env_raw = {k: v for k, _, v in pairs}
    if not isinstance(env_raw, dict):
        raise TaskFormatError(f"{where}.environment: must be a list of KEY=VALUE or a mapping")
    env = {str(k): compose.fill(v if v is not None else "", variables, f"{where}.environment.{k}") for k, v in env_raw.items()}
    workdir = compose.fill(spec["working_dir"], variables, f"{where}.working_dir") if spec.get("working_dir") else None
    build = spec.get("build")
    if build is None:
        image = spec.get("image")
        if not image:
            raise TaskFormatError(f"{where}: needs 'build' or 'image'")
        return ClientService(image=compose.fill(image, variables, f"{where}.image"), env=env, workdir=workdir)
    if isinstance(build, str):
        build = {"context": build}
    if not isinstance(build, dict):
        raise TaskFormatError(f"{where}.build: must be a path or a mapping")
    context = (path.parent / compose.fill(build.get("context", "."), variables, f"{where}.build.context")).resolve()
    if not context.is_dir():
        raise TaskFormatError(f"{where}.build.context: '{context}' is not a directory")
    dockerfile = compose.fill(build.get("dockerfile", "Dockerfile"), variables, f"{where}.build.dockerfile")
    if not (context / dockerfile).is_file():
        raise TaskFormatError(f"{where}.build: no Dockerfile '{dockerfile}' in '{context}'")
    return ClientService(context_dir=context, dockerfile=dockerfile, env=env, workdir=workdir)


def load_services(path: Path, task_id: str, client: str = CLIENT) -> compose.ComposeServices:
    """The sidecars of ``path`` and the client's named volumes."""
    return compose.load_services(path, main=client, variables=tbench_vars(task_id))

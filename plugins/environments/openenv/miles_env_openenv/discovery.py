"""Installed OpenEnv environment packages, found by OpenEnv's own convention.

An OpenEnv environment is a distribution named ``openenv-<name>`` (``openenv-core`` itself
excluded) whose top-level module ``<name>`` (``-`` read as ``_``) carries an ``openenv.yaml``
manifest; the manifest's ``app`` (default ``server.app:app``) is the ASGI app relative to that
module. This mirrors ``openenv.auto._discovery`` without importing OpenEnv (seconds) or the
environment's module (its server imports are the package's business). Distributions without a
manifest are not environments and are skipped.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from miles_engine.errors import TaskFormatError

PREFIX = "openenv-"
NOT_ENVIRONMENTS = {"openenv-core"}


@dataclass(frozen=True)
class InstalledEnvironment:
    key: str  # the name recipes use ("echo" for openenv-echo_env with name echo_env)
    package: str
    version: str
    module: str
    app: str  # "module.server.app:app"
    description: str
    search_path: Path  # the directory holding ``module`` (goes on the server's PYTHONPATH)
    manifest: dict[str, Any] = field(default_factory=dict)


def environment_key(name: str) -> str:
    """OpenEnv's env key: the manifest name without its ``_env`` suffix."""
    return name[: -len("_env")] if name.endswith("_env") else name


def _manifest_path(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)  # locates without importing
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "openenv.yaml"
        if candidate.is_file():
            return candidate
    return None


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise TaskFormatError(f"{path}: cannot read the OpenEnv manifest: {exc}") from exc
    if not isinstance(data, dict):
        raise TaskFormatError(f"{path}: an OpenEnv manifest must be a mapping, got {type(data).__name__}")
    app = data.get("app", "server.app:app")
    if not isinstance(app, str) or app.count(":") != 1:
        raise TaskFormatError(f"{path}: 'app' must read 'module.path:attribute', got {app!r}")
    return data


def discover_installed_environments() -> dict[str, InstalledEnvironment]:
    """Every installed OpenEnv environment package, by key (sorted)."""
    found: dict[str, InstalledEnvironment] = {}
    for dist in importlib.metadata.distributions():
        package = dist.metadata["Name"] or ""
        if not package.lower().startswith(PREFIX) or package.lower() in NOT_ENVIRONMENTS:
            continue
        module = package[len(PREFIX):].replace("-", "_")
        path = _manifest_path(module)
        if path is None:
            continue
        manifest = read_manifest(path)
        name = str(manifest.get("name") or module)
        key = environment_key(name)
        found[key] = InstalledEnvironment(
            key=key,
            package=package,
            version=dist.version,
            module=module,
            app=f"{module}.{manifest.get('app', 'server.app:app')}",
            description=str(manifest.get("description") or f"OpenEnv environment {name}"),
            search_path=path.parent.parent,
            manifest=manifest,
        )
    return dict(sorted(found.items()))

"""A typed mirror of Harbor's ``task.toml``, schema 1.0 through 1.4 spellings.

Field names and defaults are Harbor's (``harbor.models.task.config``). Like Harbor, keys this
mirror does not know are ignored rather than refused (newer Harbor releases add sections
often); :attr:`TaskConfig.unknown_keys` lists them so callers can warn. Deprecated 1.0
spellings are read and normalised: ``version`` (now ``schema_version``), ``memory = "4G"`` /
``storage = "10G"`` (now ``memory_mb`` / ``storage_mb``) and ``allow_internet`` (now
``network_mode``). A malformed file raises :class:`~miles_engine.errors.TaskFormatError`
naming the file, the field and its line.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from miles_engine.errors import format_validation_error
from miles_engine.errors import TaskFormatError

HarborNetworkMode = Literal["public", "no-network", "allowlist"]
DEFAULT_TIMEOUT_SEC = 600.0
_SCHEMA_RE = re.compile(r"^1\.\d+$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT])(?:I?B|I)?\s*$", re.IGNORECASE)
_SIZE_TO_MB = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
_ENV_TEMPLATE = re.compile(r"\$\{([^}:]+)(?::-(.*))?\}")


def parse_size_mb(text: str) -> int:
    """Harbor's old size strings: ``"4G"``, ``"512M"``, ``"2GB"``, ``"1Gi"`` → megabytes."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"size {text!r} is not a number followed by K, M, G or T (e.g. '4G', '512M')")
    return max(1, int(float(m.group(1)) * _SIZE_TO_MB[m.group(2).upper()]))


class _Section(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Author(_Section):
    name: str = ""
    email: str | None = None


class TaskSection(_Section):
    """``[task]`` (schema 1.1+): the task's identity."""

    name: str | None = None
    description: str = ""
    authors: list[Author | str] = Field(default_factory=list)
    keywords: list[str] = Field(default_factory=list)


class AgentSection(_Section):
    timeout_sec: float = Field(DEFAULT_TIMEOUT_SEC, gt=0)
    setup_timeout_sec: float | None = Field(None, gt=0)
    user: str | int | None = None
    network_mode: HarborNetworkMode | None = None
    allowed_hosts: list[str] | None = None


class EnvironmentSection(_Section):
    build_timeout_sec: float = Field(DEFAULT_TIMEOUT_SEC, gt=0)
    docker_image: str | None = None
    os: Literal["linux", "windows"] = "linux"
    cpus: float = Field(1, gt=0)
    memory_mb: int = Field(2048, gt=0)
    storage_mb: int = Field(10240, gt=0)
    gpus: int = Field(0, ge=0)
    gpu_types: list[str] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    network_mode: HarborNetworkMode | None = None
    allowed_hosts: list[str] = Field(default_factory=list)
    skills_dir: str | None = None
    mcp_servers: list[dict[str, Any]] = Field(default_factory=list)
    healthcheck: dict[str, Any] | None = None
    # Deprecated 1.0 spellings, normalised by the properties below.
    memory: str | None = None
    storage: str | None = None
    allow_internet: bool | None = None

    @field_validator("memory", "storage")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is not None:
            parse_size_mb(v)
        return v

    @field_validator("workdir")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError(f"workdir must be an absolute path, got {v!r}")
        return v

    @property
    def effective_memory_mb(self) -> int:
        return parse_size_mb(self.memory) if self.memory is not None else self.memory_mb

    @property
    def effective_storage_mb(self) -> int:
        return parse_size_mb(self.storage) if self.storage is not None else self.storage_mb

    def explicit_resources(self) -> dict[str, float | int]:
        """Only the resources the file sets (Harbor's defaults are not forced on a backend)."""
        out: dict[str, float | int] = {}
        given = self.model_fields_set
        if "cpus" in given:
            out["cpus"] = self.cpus
        if given & {"memory_mb", "memory"}:
            out["memory_mb"] = self.effective_memory_mb
        if given & {"storage_mb", "storage"}:
            out["disk_mb"] = self.effective_storage_mb
        if self.gpus:
            out["gpus"] = self.gpus
        return out

    def declared_network(self) -> HarborNetworkMode | None:
        """``network_mode``, else the 1.0 ``allow_internet``, else ``None`` (not declared)."""
        if self.network_mode is not None:
            return self.network_mode
        if self.allow_internet is not None:
            return "public" if self.allow_internet else "no-network"
        return None


class VerifierSection(_Section):
    timeout_sec: float = Field(DEFAULT_TIMEOUT_SEC, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    user: str | int | None = None
    environment_mode: Literal["shared", "separate"] = "shared"
    environment: EnvironmentSection | None = None
    network_mode: HarborNetworkMode | None = None
    allowed_hosts: list[str] | None = None


class SolutionSection(_Section):
    env: dict[str, str] = Field(default_factory=dict)


class ArtifactEntry(_Section):
    source: str
    destination: str | None = None


class TaskConfig(_Section):
    """One ``task.toml``."""

    schema_version: str | None = None
    version: str | None = None  # the 1.0 spelling of schema_version
    task: TaskSection | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    agent: AgentSection = Field(default_factory=AgentSection)
    verifier: VerifierSection = Field(default_factory=VerifierSection)
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)
    solution: SolutionSection = Field(default_factory=SolutionSection)
    artifacts: list[str | ArtifactEntry] = Field(default_factory=list)
    steps: list[dict[str, Any]] | None = None
    source: str | None = None
    _unknown_keys: list[str] = PrivateAttr(default_factory=list)

    @field_validator("schema_version", "version")
    @classmethod
    def _known_schema(cls, v: str | None) -> str | None:
        if v is not None and not _SCHEMA_RE.match(v):
            raise ValueError(f"unsupported task schema {v!r}; this reader understands 1.x (1.0 through 1.4)")
        return v

    @property
    def schema(self) -> str:
        return self.schema_version or self.version or "1.0"

    @property
    def unknown_keys(self) -> list[str]:
        return list(self._unknown_keys)

    def artifact_paths(self) -> list[str]:
        return [a if isinstance(a, str) else a.source for a in self.artifacts]

    # [metadata] is free-form in Harbor; these read its conventional keys leniently.
    @property
    def difficulty(self) -> str | None:
        value = self.metadata.get("difficulty")
        return str(value) if value is not None else None

    @property
    def category(self) -> str | None:
        value = self.metadata.get("category")
        return str(value) if value is not None else None

    @property
    def tags(self) -> tuple[str, ...]:
        raw = self.metadata.get("tags") or []
        tags = [raw] if isinstance(raw, str) else [str(t) for t in raw] if isinstance(raw, list) else []
        keywords = self.task.keywords if self.task else []
        return tuple(dict.fromkeys([*tags, *keywords]))

    @property
    def description(self) -> str:
        if self.task and self.task.description:
            return self.task.description
        return str(self.metadata.get("description") or "")


def _unknown(raw: dict[str, Any], model: type[BaseModel], prefix: str = "") -> list[str]:
    out: list[str] = []
    for key, value in raw.items():
        field = model.model_fields.get(key)
        if field is None:
            out.append(f"{prefix}{key}")
            continue
        sub = next((a for a in (field.annotation, *getattr(field.annotation, "__args__", ()))
                    if isinstance(a, type) and issubclass(a, _Section)), None)
        if sub is not None and isinstance(value, dict):
            out.extend(_unknown(value, sub, f"{prefix}{key}."))
    return out


_TABLE_RE = re.compile(r"^\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY_RE = re.compile(r"""^((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*=""")


def _norm_key(key: str) -> str:
    return ".".join(part.strip().strip("\"'") for part in key.split("."))


def toml_key_lines(text: str) -> dict[str, int]:
    """Best-effort ``{dotted.key: line}`` for error messages (tomllib keeps no positions)."""
    lines: dict[str, int] = {}
    table = ""
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if m := _TABLE_RE.match(stripped):
            table = _norm_key(m.group(1))
            lines.setdefault(table, number)
        elif m := _KEY_RE.match(stripped):
            key = _norm_key(m.group(1))
            lines.setdefault(f"{table}.{key}" if table else key, number)
    return lines


def parse_task_config(text: str, *, source: str) -> TaskConfig:
    """Parse ``task.toml`` text; errors name ``source``, the field and its line."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TaskFormatError(f"{source}: invalid TOML: {exc}") from exc
    try:
        config = TaskConfig.model_validate(raw)
    except ValidationError as exc:
        raise TaskFormatError(format_validation_error(exc, file=source, lines=toml_key_lines(text))) from exc
    config._unknown_keys = _unknown(raw, TaskConfig)
    return config


def load_task_config(path: Path) -> TaskConfig:
    """Read and validate one ``task.toml``."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskFormatError(f"{path}: cannot read task config: {exc}") from exc
    return parse_task_config(text, source=str(path))


def resolve_env(env: Mapping[str, str], *, where: str) -> dict[str, str]:
    """Harbor's ``${VAR}`` / ``${VAR:-default}`` values, filled from the host environment."""
    out: dict[str, str] = {}
    for key, value in env.items():
        m = _ENV_TEMPLATE.fullmatch(value)
        if m is None:
            out[key] = value
        elif m.group(1) in os.environ:
            out[key] = os.environ[m.group(1)]
        elif m.group(2) is not None:
            out[key] = m.group(2)
        else:
            raise TaskFormatError(f"{where}: {key} = '{value}' needs host environment variable {m.group(1)}, which is not set")
    return out

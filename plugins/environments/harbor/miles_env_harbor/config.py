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

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from miles_engine.errors import TaskFormatError, TaskUnsupportedError, format_validation_error

from miles_env_harbor.toml_lines import toml_key_lines

HarborNetworkMode = Literal["public", "no-network", "allowlist"]
DEFAULT_TIMEOUT_SEC = 600.0
_SCHEMA_RE = re.compile(r"^1\.\d+$")
KNOWN_SCHEMAS = ("1.0", "1.1", "1.2", "1.3", "1.4")
_STEP_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT])(?:I?B|I)?\s*$", re.IGNORECASE)
_SIZE_TO_MB = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
_ENV_TEMPLATE = re.compile(r"\$\{([^}:]+)(?::-(.*))?\}")
_KNOWN_SCHEMAS_TEXT = f"this reader knows schema_version {', '.join(KNOWN_SCHEMAS)} (and reads a later 1.x as 1.4)"


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


class HealthcheckSection(_Section):
    """``[environment.healthcheck]``: Docker HEALTHCHECK's options, run by exec once the
    environment is up; the agent starts only after it passes."""

    command: str = Field(min_length=1)
    interval_sec: float = Field(5.0, ge=0)
    timeout_sec: float = Field(30.0, gt=0)
    start_period_sec: float = Field(0.0, ge=0)
    start_interval_sec: float = Field(5.0, ge=0)
    retries: int = Field(3, ge=1)


McpTransport = Literal["sse", "streamable-http", "stdio"]


class McpServerSection(_Section):
    """One ``[[environment.mcp_servers]]``: an MCP server offered to the agent. ``sse`` and
    ``streamable-http`` servers are reached at ``url`` (typically a service of the task's
    environment/docker-compose.yaml); a ``stdio`` one is ``command`` + ``args``, run inside the
    sandbox by the agent's harness."""

    name: str = Field(min_length=1)
    transport: McpTransport = "sse"
    url: str | None = None
    command: str | None = None
    args: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _transport_fields(self) -> McpServerSection:
        if self.transport in ("sse", "streamable-http") and not self.url:
            raise ValueError(f"'url' is required for transport '{self.transport}' (MCP server '{self.name}')")
        if self.transport == "stdio" and not self.command:
            raise ValueError(f"'command' is required for transport 'stdio' (MCP server '{self.name}')")
        return self


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
    mcp_servers: list[McpServerSection] = Field(default_factory=list)
    healthcheck: HealthcheckSection | None = None
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

    @field_validator("mcp_servers")
    @classmethod
    def _unique_mcp_names(cls, v: list[McpServerSection]) -> list[McpServerSection]:
        names = [server.name for server in v]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"MCP server names must be unique; repeated: {', '.join(repeated)}")
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
    exclude: list[str] = Field(default_factory=list)


Artifact = str | ArtifactEntry


class StepAgentSection(_Section):
    """``[steps.agent]``: unset keys fall back to the task's ``[agent]``."""

    timeout_sec: float | None = Field(None, gt=0)
    user: str | int | None = None


class StepVerifierSection(_Section):
    """``[steps.verifier]``: unset keys fall back to the task's ``[verifier]``; ``env`` is merged
    over the task's (the step's value wins)."""

    timeout_sec: float | None = Field(None, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    user: str | int | None = None
    environment_mode: Literal["shared", "separate"] | None = None


class StepSection(_Section):
    """One ``[[steps]]`` entry; its files live in ``steps/<name>/``."""

    name: str
    agent: StepAgentSection = Field(default_factory=StepAgentSection)
    verifier: StepVerifierSection = Field(default_factory=StepVerifierSection)
    min_reward: float | dict[str, float] | None = None
    artifacts: list[Artifact] = Field(default_factory=list)

    @field_validator("name")
    @classmethod
    def _dir_name(cls, v: str) -> str:
        if not _STEP_NAME_RE.match(v) or v in (".", ".."):
            raise ValueError(f"step name {v!r} must be a directory name under steps/ "
                             f"(letters, digits, '.', '_', '-'; not starting with '.', '_' or '-')")
        return v

    def min_reward_failure(self, rewards: Mapping[str, float] | None) -> str | None:
        """Harbor's gate: why this step's rewards fall below ``min_reward`` (a missing key or no
        reward at all counts as -inf), or ``None`` when they pass or no gate is set."""
        if self.min_reward is None:
            return None
        gates = self.min_reward if isinstance(self.min_reward, dict) else {"reward": self.min_reward}
        for key, threshold in gates.items():
            actual = (rewards or {}).get(key, float("-inf"))
            if actual < threshold:
                return f"{key} = {actual:g} is below min_reward {threshold:g}"
        return None


def artifact_source(entry: Artifact) -> str:
    return entry if isinstance(entry, str) else entry.source


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
    artifacts: list[Artifact] = Field(default_factory=list)
    steps: list[StepSection] | None = None
    multi_step_reward_strategy: Literal["mean", "final"] | None = None
    source: str | None = None
    _unknown_keys: list[str] = PrivateAttr(default_factory=list)

    @field_validator("schema_version", "version")
    @classmethod
    def _known_schema(cls, v: str | None) -> str | None:
        if v is not None and not _SCHEMA_RE.match(v):
            raise ValueError(f"unsupported task schema {v!r}; {_KNOWN_SCHEMAS_TEXT}")
        return v

    @field_validator("steps")
    @classmethod
    def _unique_steps(cls, v: list[StepSection] | None) -> list[StepSection] | None:
        names = [step.name for step in v or []]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"step names must be unique; repeated: {', '.join(dupes)}")
        if v is not None and not v:
            raise ValueError("[[steps]] is declared but empty")
        return v

    @property
    def schema(self) -> str:
        return self.schema_version or self.version or "1.0"

    @property
    def unknown_keys(self) -> list[str]:
        return list(self._unknown_keys)

    def artifact_paths(self) -> list[str]:
        return [artifact_source(a) for a in self.artifacts]

    @property
    def reward_strategy(self) -> Literal["mean", "final"]:
        """How a multi-step task's episode reward comes from its steps' (Harbor's default: mean)."""
        return self.multi_step_reward_strategy or "mean"

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
        elif key == "steps" and isinstance(value, list):
            for index, step in enumerate(value):
                if isinstance(step, dict):
                    out.extend(_unknown(step, StepSection, f"{prefix}steps[{index}]."))
        elif sub is not None and isinstance(value, list):  # an array of tables ([[environment.mcp_servers]])
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    out.extend(_unknown(item, sub, f"{prefix}{key}[{i}]."))
    return out


def parse_task_config(text: str, *, source: str) -> TaskConfig:
    """Parse ``task.toml`` text; errors name ``source``, the field and its line."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TaskFormatError(f"{source}: invalid TOML: {exc}") from exc
    for key in ("schema_version", "version"):
        value = raw.get(key)
        if isinstance(value, str) and not _SCHEMA_RE.match(value):
            line = toml_key_lines(text).get(key)
            raise TaskUnsupportedError(f"{source}{f':{line}' if line else ''}: {key} = {value!r} is a task "
                                       f"schema this reader does not know; {_KNOWN_SCHEMAS_TEXT}")
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

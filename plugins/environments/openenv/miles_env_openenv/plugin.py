"""Registers the ``openenv`` environment: OpenEnv servers by URL, by app, or installed packages."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from miles_engine import hookimpl
from miles_engine.components import Component, Section
from miles_engine.environments.protocol import TaskLimits
from miles_engine.errors import ConfigError, did_you_mean

from miles_env_openenv.discovery import discover_installed_environments
from miles_env_openenv.server import LocalServer, RemoteServer
from miles_env_openenv.source import OpenEnvSource
from miles_env_openenv.target import Target


class OpenEnvOptions(Section):
    """Options of the ``openenv`` environment. Give at most one of ``url``, ``app`` and ``envs``;
    with none, every installed OpenEnv environment package is served."""

    url: str | None = Field(None, description="base URL of a running OpenEnv server (http:// or https://)")
    app: str | None = Field(None, description="an OpenEnv ASGI app 'module:attribute' to serve on 127.0.0.1")
    envs: list[str] = Field(default_factory=list,
                            description="installed OpenEnv packages (openenv-* with openenv.yaml) by key, served locally")
    name: str = Field("openenv", min_length=1, description="environment name in task ids for url/app")
    seeds: list[int] = Field(default_factory=lambda: list(range(8)), min_length=1,
                             description="one task per seed (reset(seed=...))")
    reset_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra reset() parameters")
    instruction: str | None = Field(None, description="the user prompt; {name} and {tool} are filled in")
    tool_name: str = Field("step", pattern=r"^[A-Za-z0-9_-]{1,64}$", description="name of the action tool")
    reward: Literal["sum", "last"] = Field("sum", description="episode reward from the step observations")
    unfinished: Literal["score", "zero", "fail"] = Field(
        "score", description="an episode that never reached done: score what was observed, 0, or a failed reward")
    max_turns: int = Field(32, ge=1)
    agent_timeout_s: float = Field(600.0, gt=0)
    connect_timeout_s: float = Field(30.0, gt=0)
    message_timeout_s: float = Field(120.0, gt=0, description="bound on each reset/step/state reply")
    capacity_wait_s: float = Field(120.0, ge=0, description="how long to wait while the server is at its session limit")
    startup_timeout_s: float = Field(120.0, gt=0, description="bound on a served app's start-up")
    max_message_mb: float = Field(16.0, gt=0)

    @field_validator("url")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {v!r}")
        return v

    @field_validator("app")
    @classmethod
    def _app(cls, v: str | None) -> str | None:
        if v is not None and v.count(":") != 1:
            raise ValueError(f"app must read 'module.path:attribute', got {v!r}")
        return v

    @model_validator(mode="after")
    def _one_target(self) -> OpenEnvOptions:
        given = [k for k, on in (("url", self.url), ("app", self.app), ("envs", self.envs)) if on]
        if len(given) > 1:
            raise ValueError(f"give at most one of url, app and envs (got {', '.join(given)})")
        return self


def make_source(options: OpenEnvOptions) -> OpenEnvSource:
    common = {"tool_name": options.tool_name}
    if options.url:
        targets = [Target(options.name, RemoteServer(options.url), **common)]
    elif options.app:
        targets = [Target(options.name, LocalServer(options.app, startup_timeout_s=options.startup_timeout_s),
                          **common)]
    else:
        installed = discover_installed_environments()
        wanted = options.envs or list(installed)
        if not wanted:
            raise ConfigError("environment 'openenv': no url or app given and no OpenEnv environment package is "
                              "installed (a distribution named openenv-<name> whose module carries openenv.yaml)")
        missing = [k for k in wanted if k not in installed]
        if missing:
            raise ConfigError(f"environment 'openenv': envs {missing} are not installed OpenEnv packages"
                              f"{did_you_mean(missing[0], installed)}; installed: {', '.join(installed) or 'none'}")
        targets = [Target(k, LocalServer(installed[k].app, python_path=[installed[k].search_path],
                                         startup_timeout_s=options.startup_timeout_s),
                          description=installed[k].description, **common) for k in wanted]
    limits = TaskLimits(max_turns=options.max_turns, agent_timeout_s=options.agent_timeout_s,
                        verifier_timeout_s=options.message_timeout_s + 5)
    return OpenEnvSource(targets, seeds=options.seeds, name="openenv", instruction=options.instruction, limits=limits,
                         reset_kwargs=options.reset_kwargs, reward_mode=options.reward, unfinished=options.unfinished,
                         connect_timeout_s=options.connect_timeout_s, message_timeout_s=options.message_timeout_s,
                         capacity_wait_s=options.capacity_wait_s,
                         max_message_bytes=int(options.max_message_mb * 2**20))


@hookimpl
def miles_register_environments() -> list[Component]:
    return [Component("openenv", make_source, options=OpenEnvOptions,
                      description="OpenEnv servers (reset/step/state over /ws): by URL, by app, or installed openenv-* packages")]

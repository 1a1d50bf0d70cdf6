"""miles environment plugin for OpenEnv (openenv-core 0.3.0 server protocol), spoken over its wire API."""

from miles_env_openenv.discovery import InstalledEnvironment, discover_installed_environments
from miles_env_openenv.plugin import OpenEnvOptions
from miles_env_openenv.server import LocalServer, OpenEnvServerError, RemoteServer
from miles_env_openenv.source import OpenEnvSource
from miles_env_openenv.target import Target, action_tool
from miles_env_openenv.task import OpenEnvTask

__all__ = [
    "InstalledEnvironment",
    "LocalServer",
    "OpenEnvOptions",
    "OpenEnvServerError",
    "OpenEnvSource",
    "OpenEnvTask",
    "RemoteServer",
    "Target",
    "action_tool",
    "discover_installed_environments",
]

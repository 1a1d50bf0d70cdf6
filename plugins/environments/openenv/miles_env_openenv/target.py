"""One OpenEnv environment a source serves tasks from: its server and its action schema as a tool."""

from __future__ import annotations

import threading
from typing import Any

from miles_engine.environments.protocol import ToolSpec

from miles_env_openenv.server import LocalServer, OpenEnvServerError, RemoteServer, fetch_json

ACTION_KEYS_HIDDEN = ("metadata",)  # the base Action's free-form metadata is not the model's to fill


def action_tool(name: str, action_schema: dict[str, Any], env_description: str) -> ToolSpec:
    """The server's action JSON schema as one function-calling tool (``metadata`` removed)."""
    if action_schema.get("type", "object") != "object" or not isinstance(action_schema.get("properties", {}), dict):
        raise OpenEnvServerError(f"the OpenEnv action schema is not a JSON object schema: {str(action_schema)[:300]}")
    props = {k: v for k, v in action_schema.get("properties", {}).items() if k not in ACTION_KEYS_HIDDEN}
    params: dict[str, Any] = {"type": "object", "properties": props,
                              "required": [r for r in action_schema.get("required", []) if r in props],
                              "additionalProperties": False}
    if action_schema.get("$defs"):
        params["$defs"] = action_schema["$defs"]
    what = action_schema.get("description") or action_schema.get("title") or "action"
    description = (f"Take one step in the environment with an action ({what}). Returns the observation, "
                   f"the step's reward and whether the episode is done.")
    if env_description:
        description = f"{description} Environment: {env_description}"
    return ToolSpec(name=name, description=description, parameters=params)


class Target:
    """An environment name, where its server is, and (fetched once) its tool."""

    def __init__(self, name: str, server: RemoteServer | LocalServer, *, tool_name: str, description: str = "",
                 http_timeout_s: float = 30.0) -> None:
        self.name = name
        self.server = server
        self.tool_name = tool_name
        self.description = description
        self.http_timeout_s = http_timeout_s
        self._tool: ToolSpec | None = None
        self._lock = threading.Lock()

    def base_url(self) -> str:
        return self.server.ensure_started()

    def tool(self) -> ToolSpec:
        """The action tool (blocking: starts the server / fetches ``/schema`` on first call)."""
        with self._lock:
            if self._tool is None:
                base = self.base_url()
                schema = fetch_json(base, "/schema", self.http_timeout_s)
                action = schema.get("action")
                if not isinstance(action, dict):
                    raise OpenEnvServerError(f"OpenEnv server at {base}/schema has no 'action' schema")
                description = self.description
                if not description:
                    try:
                        description = str(fetch_json(base, "/metadata", self.http_timeout_s).get("description") or "")
                    except OpenEnvServerError:
                        description = ""  # metadata is informative only
                self._tool = action_tool(self.tool_name, action, description)
            return self._tool

"""MCP servers a task offers its agent, and the configs agent CLIs read them from.

A task lists them in ``metadata["mcp_servers"]``: dicts with ``name``, ``transport`` (``sse``,
``streamable-http`` or ``stdio``), ``url`` (the first two; an address as the sandbox sees it,
e.g. a sidecar service's name) or ``command`` + ``args`` (stdio: the agent CLI spawns it inside
the sandbox). The Harbor environment fills it from ``[[environment.mcp_servers]]``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

McpTransport = Literal["sse", "streamable-http", "stdio"]
MCP_SERVERS_KEY = "mcp_servers"
_BARE_TOML_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class McpServer:
    name: str
    transport: McpTransport
    url: str | None = None
    command: str | None = None
    args: tuple[str, ...] = ()


def task_mcp_servers(task: Any) -> list[McpServer]:
    """The MCP servers in ``task.metadata`` (none when it lists none); a malformed entry is a ValueError."""
    raw = (getattr(task, "metadata", None) or {}).get(MCP_SERVERS_KEY) or []
    servers = []
    for entry in raw:
        transport = entry.get("transport", "sse")
        if transport not in ("sse", "streamable-http", "stdio"):
            raise ValueError(f"task '{getattr(task, 'id', '?')}': MCP server {entry.get('name')!r} has transport "
                             f"{transport!r}; allowed: sse, streamable-http, stdio")
        if (transport == "stdio" and not entry.get("command")) or (transport != "stdio" and not entry.get("url")):
            raise ValueError(f"task '{getattr(task, 'id', '?')}': MCP server {entry.get('name')!r} ({transport}) "
                             f"lacks its {'command' if transport == 'stdio' else 'url'}")
        servers.append(McpServer(name=str(entry["name"]), transport=transport, url=entry.get("url"),
                                 command=entry.get("command"), args=tuple(str(a) for a in entry.get("args") or ())))
    return servers


def claude_mcp_config(servers: list[McpServer]) -> str:
    """Claude Code's ``--mcp-config`` JSON (``{"mcpServers": {...}}``, ``http`` for streamable HTTP)."""
    entries: dict[str, dict[str, Any]] = {}
    for s in servers:
        if s.transport == "stdio":
            entries[s.name] = {"type": "stdio", "command": s.command, "args": list(s.args)}
        else:
            entries[s.name] = {"type": "sse" if s.transport == "sse" else "http", "url": s.url}
    return json.dumps({"mcpServers": entries})


def codex_mcp_toml(servers: list[McpServer]) -> str:
    """Codex's ``[mcp_servers.NAME]`` tables (stdio: command/args; streamable HTTP: url). Codex
    has no SSE client: an ``sse`` server is listed in a comment only."""
    lines: list[str] = []
    for s in servers:
        key = s.name if _BARE_TOML_KEY.match(s.name) else json.dumps(s.name)
        if s.transport == "sse":
            lines.append(f"# MCP server {s.name} (sse, {s.url}) left out: codex speaks stdio and streamable HTTP only")
            continue
        lines.append(f"[mcp_servers.{key}]")
        if s.transport == "stdio":
            lines += [f"command = {json.dumps(s.command)}", f"args = {json.dumps(list(s.args))}"]
        else:
            lines.append(f"url = {json.dumps(s.url)}")
    return "\n".join(lines) + ("\n" if lines else "")

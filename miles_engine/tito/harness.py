"""The harness agent (``harness``): a coding-agent CLI run *inside the episode's sandbox* against
its own session, then the session's trajectories collected.

The harness reaches the session server through :mod:`.forwarder` when the sandbox has its own
network namespace (the local backend's namespace tier without public network): a Unix socket
in the sandbox's ``/tmp`` plus a loopback relay inside it. A process-tier sandbox (or one with
public network) shares the host's loopback and gets the server's URL directly. A sandbox with
``route_to_host(host, port)`` (the docker backend: a forwarder container in the sandbox's
network namespace, see ``miles_sandbox_docker.route``) gets a per-episode route to the server
only. Other backends are refused with that reason.

Presets (``preset``), each non-interactive with the sandbox as its permission boundary:

- ``claude-code``: ``claude -p PROMPT --dangerously-skip-permissions`` with ``ANTHROPIC_BASE_URL``
  (Messages API) and ``ANTHROPIC_MODEL`` = ``model``; ``IS_SANDBOX=1`` (it runs as the sandbox's
  root), nonessential traffic and the autoupdater off.
- ``codex``: ``codex exec --dangerously-bypass-approvals-and-sandbox PROMPT`` with a
  ``CODEX_HOME/config.toml`` naming a ``miles`` model provider (``wire_api = "responses"``).
- ``custom``: ``command`` (a bash script) with the variables below.

The script sees ``MILES_SESSION_URL`` (``…/sessions/ID``, append ``/v1`` for OpenAI clients),
``MILES_API_KEY``, ``MILES_MODEL``, ``MILES_TASK_PROMPT``, ``MILES_MAX_TURNS``, ``MILES_HARNESS_BIN``
(where the CLIs are, as the sandbox sees it) and ``HOME`` (a fresh dir in the sandbox's /tmp).
When the task offers MCP servers (``metadata["mcp_servers"]``, see :mod:`miles_engine.agents.mcp`)
it also sees ``MILES_MCP_CONFIG`` (Claude Code's ``--mcp-config`` JSON, which the ``claude-code``
preset passes) and ``MILES_MCP_CODEX_TOML`` (``[mcp_servers.*]`` tables the ``codex`` preset
appends to its config.toml).
The CLIs come from ``scripts/install_harnesses.sh``; a namespace sandbox sees them when the
local backend binds the cache read-only (``ro_binds: {"/miles/harnesses": "<cache dir>"}``), a
docker sandbox with the docker backend's ``ro_binds`` (both CLIs' npm packages carry native
binaries: Claude Code's needs glibc, Codex's is static; no node in the image).
"""

from __future__ import annotations

import os
import shlex
import time
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field

from miles_engine.components import Section
from miles_engine.agents.mcp import claude_mcp_config, codex_mcp_toml, task_mcp_servers
from miles_engine.agents.protocol import AgentResult
from miles_engine.environments.protocol import EpisodeContext
from miles_engine.tito.agent import collect_into
from miles_engine.tito.client import SessionClient, server_url
from miles_engine.tito.forwarder import RELAY, SANDBOX_DIR, SOCKET_NAME, UnixForwarder

TAIL = 4000


def default_harness_dir() -> str:
    """Where scripts/install_harnesses.sh installs: $MILES_HARNESS_DIR, else (root, whose sandboxes
    run under their own uids and cannot read /root) /var/cache/…, else ~/.cache/…"""
    if os.environ.get("MILES_HARNESS_DIR"):
        return os.environ["MILES_HARNESS_DIR"]
    if os.geteuid() == 0:
        return "/var/cache/miles-engine/harnesses"
    return os.path.expanduser("~/.cache/miles-engine/harnesses")


SANDBOX_HARNESS_DIR = "/miles/harnesses"  # where the local backend's ro_binds puts the cache

PRESETS = {
    "claude-code": r"""
IS_SANDBOX=1 ANTHROPIC_BASE_URL="$MILES_SESSION_URL" ANTHROPIC_API_KEY="$MILES_API_KEY" \
ANTHROPIC_MODEL="$MILES_MODEL" ANTHROPIC_SMALL_FAST_MODEL="$MILES_MODEL" \
CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 DISABLE_TELEMETRY=1 \
"$MILES_HARNESS_BIN/claude" -p "$MILES_TASK_PROMPT" --dangerously-skip-permissions \
  --max-turns "$MILES_MAX_TURNS" --output-format json ${MILES_MCP_CONFIG:+--mcp-config "$MILES_MCP_CONFIG"}
""",
    "codex": r"""
export CODEX_HOME="$HOME/.codex"
mkdir -p "$CODEX_HOME"
cat > "$CODEX_HOME/config.toml" <<EOF
model = "$MILES_MODEL"
model_provider = "miles"
[model_providers.miles]
name = "miles"
base_url = "$MILES_SESSION_URL/v1"
env_key = "MILES_API_KEY"
wire_api = "responses"
EOF
[ -n "${MILES_MCP_CODEX_TOML:-}" ] && printf '%s\n' "$MILES_MCP_CODEX_TOML" >> "$CODEX_HOME/config.toml"
codex="$MILES_HARNESS_BIN/codex"
if ! command -v node >/dev/null 2>&1; then  # no node (a container image): the package's static binary
  native=$(ls "$MILES_HARNESS_BIN"/../@openai/codex-linux-*/vendor/*-unknown-linux-musl/bin/codex 2>/dev/null | head -n 1)
  [ -n "$native" ] && codex="$native"
fi
"$codex" exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox \
  "$MILES_TASK_PROMPT"
""",
}

# Runs inside the sandbox: start the loopback relay when there is a socket, wait for its port,
# run the harness, stop the relay.
WRAPPER = r"""
set -u
mkdir -p "$HOME"
relay=
if [ -n "${MILES_RELAY_SOCKET:-}" ]; then
  port_file=/tmp/.miles-relay-port  # the socket's dir belongs to the host; /tmp itself to the sandbox
  rm -f "$port_file"
  python3 -c "$MILES_RELAY" "$MILES_RELAY_SOCKET" "$port_file" &
  relay=$!
  for _ in $(seq 1 400); do [ -s "$port_file" ] && break; sleep 0.025; done
  [ -s "$port_file" ] || { echo "miles: the session relay did not start" >&2; kill $relay 2>/dev/null; exit 97; }
  export MILES_SESSION_URL="http://127.0.0.1:$(cat "$port_file")$MILES_SESSION_PATH"
fi
(
HARNESS
)
rc=$?
[ -n "$relay" ] && kill $relay 2>/dev/null
exit $rc
"""


class HarnessAgentOptions(Section):
    preset: Literal["claude-code", "codex", "custom"] = Field(..., description="which harness to run")
    command: str | None = Field(None, description="custom: the bash script to run (see the MILES_* variables)")
    server_url: str | None = Field(None, description="session server root URL (default: $MILES_TITO_URL)")
    api_key: str = "miles"
    model: str = Field("miles-policy", description="the model name the harness asks for (any name: the session "
                       "serves the policy)")
    mode: Literal["linear", "branching"] = "linear"
    harness_dir: str | None = Field(None, description="host dir scripts/install_harnesses.sh installed into "
                                    "(its node_modules/.bin holds claude and codex); default: its default")
    sandbox_harness_dir: str = Field(SANDBOX_HARNESS_DIR, description="the same dir as a namespace or docker "
                                     "sandbox sees it (the backend's ro_binds)")
    max_turns: int | None = Field(None, ge=1, description="default: the task's limits.max_turns")
    timeout_s: float | None = Field(None, gt=0, description="default: the task's agent timeout minus 5%")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of the harness")
    keep_session: bool = False


def mcp_env(task: Any) -> dict[str, str]:
    """The harness's MCP variables for the servers ``task`` offers (none: no variables)."""
    servers = task_mcp_servers(task)
    if not servers:
        return {}
    return {"MILES_MCP_CONFIG": claude_mcp_config(servers), "MILES_MCP_CODEX_TOML": codex_mcp_toml(servers)}


def _route(sandbox: Any) -> Literal["direct", "socket", "sandbox"]:
    """How the sandbox reaches a loopback server: its own loopback is the host's, a socket, or
    the sandbox's own ``route_to_host``."""
    isolation = getattr(sandbox, "isolation", None)
    spec = getattr(sandbox, "spec", None)
    public = spec is not None and spec.network.mode == "public"
    if isolation == "process" or (public and isolation == "namespace"):
        return "direct"
    if isolation == "namespace" and isinstance(getattr(sandbox, "mapped", None), dict) and "/tmp" in sandbox.mapped:
        return "socket"
    if callable(getattr(sandbox, "route_to_host", None)):
        return "sandbox"
    raise RuntimeError(f"the harness agent cannot route {type(sandbox).__name__} (isolation {isolation!r}) to the "
                       "session server: it needs the local backend's sandboxes or a sandbox with "
                       "route_to_host(host, port) (the docker backend)")


class HarnessAgent:
    name = "harness"

    def __init__(self, options: HarnessAgentOptions) -> None:
        if options.preset == "custom" and not options.command:
            raise ValueError("harness agent: preset 'custom' needs 'command'")
        self.options = options

    def script(self) -> str:
        o = self.options
        body = o.command if o.preset == "custom" else PRESETS[o.preset]
        return WRAPPER.replace("HARNESS", body.strip())  # type: ignore[union-attr]

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        o = self.options
        root = server_url(o.server_url)
        client = SessionClient(root, api_key=o.api_key, use_openai=False)
        stop, info, started = "done", {}, time.monotonic()
        forwarder: UnixForwarder | None = None
        try:
            sandbox = ctx.sandbox
            if sandbox is None:
                raise RuntimeError("the harness agent runs inside the task's sandbox; this task has none")
            route = _route(sandbox)
            await client.open(mode=o.mode, metadata={"task_id": ctx.task.id, "agent": self.name,
                                                     "harness": o.preset})
            session_path = f"/sessions/{client.session_id}"
            prompt = "\n\n".join(str(m.get("content") or "") for m in ctx.task.prompt() if m.get("role") == "user")
            env = {"HOME": "/tmp/miles-harness-home", "MILES_API_KEY": o.api_key, "MILES_MODEL": o.model,
                   "MILES_TASK_PROMPT": prompt, "MILES_SESSION_ID": client.session_id,
                   "MILES_SESSION_PATH": session_path,
                   "MILES_MAX_TURNS": str(o.max_turns or ctx.task.limits.max_turns), **mcp_env(ctx.task), **o.env}
            if route == "socket":
                parts = urlsplit(root)
                host_dir = os.path.join(sandbox.mapped["/tmp"], SANDBOX_DIR.removeprefix("/tmp/"))  # type: ignore[attr-defined]
                forwarder = UnixForwarder(os.path.join(host_dir, SOCKET_NAME), parts.hostname or "127.0.0.1",
                                          parts.port or 80)
                await forwarder.start()
                env.update(MILES_RELAY=RELAY, MILES_RELAY_SOCKET=f"{SANDBOX_DIR}/{SOCKET_NAME}",
                           MILES_HARNESS_BIN=f"{o.sandbox_harness_dir}/node_modules/.bin")
            elif route == "sandbox":
                parts = urlsplit(root)
                base = await sandbox.route_to_host(parts.hostname or "127.0.0.1", parts.port or 80)
                env.update(MILES_SESSION_URL=base + session_path,
                           MILES_HARNESS_BIN=f"{o.sandbox_harness_dir}/node_modules/.bin")
            else:
                env.update(MILES_SESSION_URL=root + session_path,
                           MILES_HARNESS_BIN=os.path.join(os.path.expanduser(o.harness_dir or default_harness_dir()), "node_modules", ".bin"))
            timeout = o.timeout_s or ctx.task.limits.agent_timeout_s * 0.95
            result = await sandbox.exec(self.script(), env=env, timeout_s=timeout)
            info.update(exit_code=result.exit_code, stdout_tail=result.stdout[-TAIL:],
                        stderr_tail=result.stderr[-TAIL:], wall_s=round(time.monotonic() - started, 3))
            if result.timed_out:
                stop = "timeout"
            elif result.exit_code:
                stop = "error"
                info["error"] = f"harness {o.preset} exited with status {result.exit_code}: " \
                                f"{shlex.quote(result.stderr.strip()[-300:])}"
        except Exception as exc:
            stop = "error"
            info["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            report = await collect_into(ctx, client, o.keep_session)
            if forwarder is not None:
                await forwarder.close()
        trajectories = report.get("trajectories", [])
        turns = sum(len(t["turns"]) for t in trajectories)
        if trajectories:
            last = [m for m in trajectories[-1]["messages"] if m["role"] == "assistant"]
            if last and not last[-1].get("tool_calls"):
                ctx.say(last[-1]["content"])
        info.update(session_id=report.get("session_id"), trajectories=trajectories,
                    tito_metrics=report.get("metrics", {}))
        if report.get("error"):
            info["collect_error"] = report["error"]
        return AgentResult(turns=turns, stop_reason=stop, info=info)

"""[environment.healthcheck] and [[environment.mcp_servers]] as Harbor types them, the image's
ENTRYPOINT kept (SandboxSpec.keep_entrypoint) and refused per task where a backend replaces it,
and the MCP servers a harness hands its agent CLI."""

from __future__ import annotations

import asyncio
import json
import tomllib

import pytest
from harbor_testkit import DEFAULT_TOML, make_task

from miles_engine.agents.mcp import claude_mcp_config, codex_mcp_toml, task_mcp_servers
from miles_engine.environments.admission import admit_tasks
from miles_engine.environments.protocol import EpisodeContext
from miles_engine.errors import HealthcheckError, TaskFormatError
from miles_engine.sandbox.protocol import Capabilities, ExecResult
from miles_engine.tito.harness import mcp_env
from miles_env_harbor import HarborSource, load_harbor_task
from miles_env_harbor.config import parse_task_config

HEALTHCHECK = """
[environment.healthcheck]
command = "python3 -c 'import urllib.request; urllib.request.urlopen(\\"http://localhost:8000\\")'"
interval_sec = 0.5
retries = 2
"""

MCP = """
[[environment.mcp_servers]]
name = "search"
transport = "streamable-http"
url = "http://mcp:8765/mcp"

[[environment.mcp_servers]]
name = "files"
transport = "stdio"
command = "python3"
args = ["-m", "files_mcp", "--root", "/app"]

[[environment.mcp_servers]]
name = "legacy"
url = "http://mcp:8766/sse"
"""

ENTRYPOINT_DOCKERFILE = 'FROM ubuntu:24.04\nCOPY start.sh /start.sh\nENTRYPOINT ["/start.sh"]\n'
# a backend like the cloud ones: images and builds, but the image's ENTRYPOINT is replaced
CLOUD_CAPS = Capabilities(isolation="container", network_modes=frozenset({"none", "public"}), images=True,
                          dockerfile_build=True, absolute_paths=True)


def test_healthcheck_fields_and_defaults_are_harbors():
    check = parse_task_config('[environment.healthcheck]\ncommand = "true"\n', source="x").environment.healthcheck
    assert check is not None
    assert (check.command, check.interval_sec, check.timeout_sec, check.start_period_sec, check.start_interval_sec,
            check.retries) == ("true", 5.0, 30.0, 0.0, 5.0, 3)
    assert parse_task_config("", source="x").environment.healthcheck is None


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[environment.healthcheck]\ninterval_sec = 1\n",
         r"task\.toml:1: missing required key 'environment\.healthcheck\.command'"),
        ('[environment.healthcheck]\ncommand = "true"\nretries = 0\n',
         r"task\.toml:3: bad value for 'environment\.healthcheck\.retries'"),
        ('[[environment.mcp_servers]]\nname = "a"\ntransport = "sse"\n',
         r"task\.toml:1: bad value for 'environment\.mcp_servers\.0'.*'url' is required for transport 'sse'"),
        ('[[environment.mcp_servers]]\nname = "a"\ntransport = "stdio"\n',
         r"'command' is required for transport 'stdio'"),
        ('[[environment.mcp_servers]]\nname = "a"\ntransport = "websocket"\nurl = "ws://x"\n',
         r"'environment\.mcp_servers\.0\.transport'.*'sse', 'streamable-http' or 'stdio'"),
        ('[[environment.mcp_servers]]\nname = "a"\nurl = "http://x"\n[[environment.mcp_servers]]\nname = "a"\n'
         'url = "http://y"\n', r"MCP server names must be unique; repeated: a"),
    ],
)
def test_bad_healthcheck_or_mcp_entries_name_file_key_and_line(text, needle):
    with pytest.raises(TaskFormatError, match=needle):
        parse_task_config(text, source="tasks/a/task.toml")


def test_unknown_keys_of_an_mcp_server_or_the_healthcheck_are_listed():
    cfg = parse_task_config('[environment.healthcheck]\ncommand = "true"\nshiny = 1\n[[environment.mcp_servers]]\n'
                            'name = "a"\nurl = "http://a"\nheaders = { X = "1" }\n', source="x")
    assert cfg.unknown_keys == ["environment.healthcheck.shiny", "environment.mcp_servers[0].headers"]


def test_mcp_servers_reach_the_task_metadata_and_the_harness_configs(tmp_path):
    task = load_harbor_task(make_task(tmp_path, toml=DEFAULT_TOML + MCP))
    assert task.metadata["mcp_servers"] == [
        {"name": "search", "transport": "streamable-http", "url": "http://mcp:8765/mcp", "args": []},
        {"name": "files", "transport": "stdio", "command": "python3", "args": ["-m", "files_mcp", "--root", "/app"]},
        {"name": "legacy", "transport": "sse", "url": "http://mcp:8766/sse", "args": []},
    ]
    servers = task_mcp_servers(task)
    assert json.loads(claude_mcp_config(servers)) == {"mcpServers": {
        "search": {"type": "http", "url": "http://mcp:8765/mcp"},
        "files": {"type": "stdio", "command": "python3", "args": ["-m", "files_mcp", "--root", "/app"]},
        "legacy": {"type": "sse", "url": "http://mcp:8766/sse"},
    }}
    codex = tomllib.loads(codex_mcp_toml(servers))
    assert codex == {"mcp_servers": {"search": {"url": "http://mcp:8765/mcp"},
                                     "files": {"command": "python3", "args": ["-m", "files_mcp", "--root", "/app"]}}}
    env = mcp_env(task)
    assert json.loads(env["MILES_MCP_CONFIG"])["mcpServers"]["search"]["url"] == "http://mcp:8765/mcp"
    assert "legacy (sse" in env["MILES_MCP_CODEX_TOML"]  # codex has no SSE client: named, left out
    assert mcp_env(load_harbor_task(make_task(tmp_path, "plain"))) == {}


def test_the_claude_preset_passes_the_mcp_config_only_when_there_is_one(tmp_path):
    from miles_engine.tito.harness import HarnessAgent, HarnessAgentOptions

    script = HarnessAgent(HarnessAgentOptions(preset="claude-code")).script()
    assert '${MILES_MCP_CONFIG:+--mcp-config "$MILES_MCP_CONFIG"}' in script
    codex = HarnessAgent(HarnessAgentOptions(preset="codex")).script()
    assert '"$MILES_MCP_CODEX_TOML" >> "$CODEX_HOME/config.toml"' in codex


def _entrypoint_task(tmp_path, name="served", dockerfile=ENTRYPOINT_DOCKERFILE, toml=DEFAULT_TOML):
    task_dir = make_task(tmp_path, name, toml=toml)
    (task_dir / "environment").mkdir()
    (task_dir / "environment" / "Dockerfile").write_text(dockerfile)
    (task_dir / "environment" / "start.sh").write_text('#!/bin/sh\nexec "$@"\n')
    return task_dir


def test_a_dockerfile_with_an_entrypoint_asks_to_keep_it(tmp_path):
    assert load_harbor_task(_entrypoint_task(tmp_path)).sandbox_spec().keep_entrypoint
    lower = _entrypoint_task(tmp_path, "lower", dockerfile="FROM ubuntu:24.04\nentrypoint /start.sh\n")
    assert load_harbor_task(lower).sandbox_spec().keep_entrypoint
    cmd_only = _entrypoint_task(tmp_path, "cmd", dockerfile='FROM ubuntu:24.04\nCMD ["sleep", "1"]\n')
    assert not load_harbor_task(cmd_only).sandbox_spec().keep_entrypoint  # Harbor replaces CMD anyway
    assert not load_harbor_task(_entrypoint_task(tmp_path, "ignored"), ignore_dockerfile=True).sandbox_spec().keep_entrypoint
    named = _entrypoint_task(tmp_path, "named", toml=DEFAULT_TOML + '[environment]\ndocker_image = "acme/served:1"\n')
    spec = load_harbor_task(named).sandbox_spec()
    assert spec.image == "acme/served:1" and spec.keep_entrypoint  # judged by the Dockerfile shipped with it


def test_a_backend_that_replaces_the_entrypoint_excludes_only_that_task(tmp_path):
    _entrypoint_task(tmp_path, "served")
    plain = make_task(tmp_path, "plain")
    (plain / "environment").mkdir()
    (plain / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\n")
    admission = admit_tasks(HarborSource(path=tmp_path), "modal", CLOUD_CAPS)
    assert admission.admitted == ["plain"]
    [excluded] = admission.excluded
    assert excluded.kind == "backend" and excluded.task_id == "served"
    assert "the image's ENTRYPOINT running as the container's main process" in excluded.reason
    assert f"{tmp_path / 'served' / 'environment' / 'Dockerfile'} sets ENTRYPOINT" in excluded.reason
    assert "what would run it: a sandbox backend that provides it: docker" in excluded.reason
    ok = admit_tasks(HarborSource(path=tmp_path), "docker", CLOUD_CAPS.model_copy(update={"keep_entrypoint": True}))
    assert sorted(ok.admitted) == ["plain", "served"]


class ProbeSandbox:
    """Answers the log-dir mkdir, then the healthcheck with the scripted results."""

    def __init__(self, *results: ExecResult) -> None:
        self.results = list(results)
        self.commands: list[str] = []

    async def exec(self, cmd, **_):
        self.commands.append(cmd)
        if cmd.startswith("mkdir -p /logs"):
            return ExecResult(exit_code=0, stdout="", stderr="")
        return self.results.pop(0)


def test_setup_waits_for_the_healthcheck_and_fails_with_its_last_output(tmp_path):
    toml = DEFAULT_TOML + HEALTHCHECK.replace("interval_sec = 0.5", "interval_sec = 0")
    task = load_harbor_task(make_task(tmp_path, toml=toml))
    down = ExecResult(exit_code=1, stdout="", stderr="ConnectionRefusedError: [Errno 111]")
    up = ExecResult(exit_code=0, stdout="", stderr="")
    ctx = EpisodeContext(task=task, sandbox=ProbeSandbox(down, up))
    asyncio.run(task.setup(ctx))
    assert ctx.info["healthcheck"]["tries"] == 2
    ctx = EpisodeContext(task=task, sandbox=ProbeSandbox(down, down))
    with pytest.raises(HealthcheckError) as exc:
        asyncio.run(task.setup(ctx))
    msg = str(exc.value)
    assert f"task 'answer' ({task.toml_path} [environment.healthcheck])" in msg
    assert "urllib.request.urlopen" in msg and "ConnectionRefusedError: [Errno 111]" in msg

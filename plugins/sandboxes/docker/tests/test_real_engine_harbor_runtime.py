"""Harbor's runtime on a real container engine (the set-up and skip of test_real_engine.py), with
task directories written here: the image's ENTRYPOINT starts a server and keeps running
(SandboxSpec.keep_entrypoint), [environment.healthcheck] gates the agent on it, a check that never
passes fails the episode as an environment error (no reward, the check named, nothing left), and
an MCP server served by a compose sidecar is reached at the address the agent is given."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from miles_engine.agents.builtin import NopAgent, OracleAgent
from miles_engine.agents.mcp import task_mcp_servers
from miles_engine.agents.protocol import AgentResult
from miles_engine.environments.protocol import EpisodeContext
from miles_engine.errors import SandboxError
from miles_engine.rollout.episode import run_episode
from miles_engine.tito.harness import mcp_env
from miles_engine.sandbox.protocol import BuildContext, SandboxSpec
from miles_env_harbor import load_harbor_task

from .real_engine import backend, containers_of, leftover, run

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("real_engine")]

FETCH = "import urllib.request; print(urllib.request.urlopen('{url}', timeout=5).read().decode().strip())"
SERVE_SH = """\
#!/bin/sh
# the image's ENTRYPOINT: a secret only this script creates, served on loopback; then the command
mkdir -p /srv && printf 'token-%s\\n' "$(cat /proc/sys/kernel/random/uuid)" > /srv/secret.txt
python3 -m http.server 8000 --bind 127.0.0.1 --directory /srv > /tmp/server.log 2>&1 &
exec "$@"
"""
DOCKERFILE = """\
FROM ubuntu:24.04
COPY serve.sh /usr/local/bin/serve.sh
RUN chmod 0755 /usr/local/bin/serve.sh
WORKDIR /app
ENTRYPOINT ["/usr/local/bin/serve.sh"]
"""
TEST_SH = """\
#!/bin/bash
expected=$(python3 -c "{fetch}")
if [ -n "$expected" ] && [ "$(cat /app/answer.txt 2>/dev/null)" = "$expected" ]; then r=1; else r=0; fi
echo $r > /logs/verifier/reward.txt
"""


def write_task(root: Path, name: str, *, toml: str, files: dict[str, str], test_sh: str,
               solve_sh: str = "") -> Path:
    task = root / name
    for rel, text in {"task.toml": toml, "instruction.md": f"Task {name}.\n", "tests/test.sh": test_sh,
                      **({"solution/solve.sh": solve_sh} if solve_sh else {}), **files}.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(textwrap.dedent(text))
    return task


def served_task(root: Path, name: str, healthcheck_url: str, retries: int) -> Path:
    secret = "http://127.0.0.1:8000/secret.txt"
    toml = f"""\
        schema_version = "1.4"
        [agent]
        timeout_sec = 60.0
        [verifier]
        timeout_sec = 60.0
        [environment.healthcheck]
        command = "python3 -c \\"import urllib.request; urllib.request.urlopen('{healthcheck_url}', timeout=5)\\""
        interval_sec = 0.5
        timeout_sec = 10.0
        retries = {retries}
        """
    return write_task(root, name, toml=toml, files={"environment/Dockerfile": DOCKERFILE,
                                                    "environment/serve.sh": SERVE_SH},
                      test_sh=TEST_SH.format(fetch=FETCH.format(url=secret).replace('"', '\\"')),
                      solve_sh=f'#!/bin/bash\npython3 -c "{FETCH.format(url=secret)}" > /app/answer.txt\n')


def test_entrypoint_server_is_up_when_the_agent_starts_oracle_one_nop_zero(tmp_path: Path):
    task_dir = served_task(tmp_path, "served", "http://127.0.0.1:8000/secret.txt", retries=40)
    assert load_harbor_task(task_dir).sandbox_spec().keep_entrypoint
    be = backend()
    oracle = run(run_episode(load_harbor_task(task_dir), OracleAgent(), be))
    assert (oracle.reward.reward, oracle.reward.error) == (1.0, None), (oracle.reward, oracle.info)
    assert oracle.info["healthcheck"]["tries"] >= 1
    nop = run(run_episode(load_harbor_task(task_dir), NopAgent(), be))
    assert (nop.reward.reward, nop.reward.error) == (0.0, None), nop.reward
    assert containers_of(be.run_id) == []


def test_a_healthcheck_that_never_passes_is_an_environment_error_not_a_zero(tmp_path: Path):
    task_dir = served_task(tmp_path, "never-healthy", "http://127.0.0.1:9/", retries=2)
    be = backend()
    result = run(run_episode(load_harbor_task(task_dir), OracleAgent(), be))
    assert result.reward.reward is None and not result.reward_error, result.reward
    error = result.reward.error or ""
    assert "setup of task 'never-healthy' failed: HealthcheckError:" in error, error
    assert "[environment.healthcheck]): healthcheck did not pass: `python3 -c \"import urllib.request; " \
           "urllib.request.urlopen('http://127.0.0.1:9/', timeout=5)\"` failed 2 consecutive time(s)" in error, error
    assert "Connection refused" in error, error
    assert result.agent.stop_reason == "not_started" and "solution" not in result.info  # the agent never ran
    assert containers_of(be.run_id) == []


COMPOSE = """\
services:
  main:
    depends_on:
      mcp:
        condition: service_healthy
  mcp:
    image: ubuntu:24.04
    command: ["/bin/sh", "-c", "mkdir -p /srv/mcp && printf 'mcp-ok\\n' > /srv/mcp/index.html && exec python3 -m http.server 8765 --directory /srv"]
    healthcheck:
      test: ["CMD-SHELL", "python3 -c \\"import urllib.request; urllib.request.urlopen('http://localhost:8765/mcp/')\\""]
"""


class McpProbeAgent:
    """Fetches each URL MCP server the task offers from inside the sandbox, writes what it got."""

    name = "mcp-probe"

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        [server] = [s for s in task_mcp_servers(ctx.task) if s.url]
        got = await ctx.sandbox.exec(f'python3 -c "{FETCH.format(url=server.url)}" > /app/answer.txt', timeout_s=30)
        ctx.info["probe"] = {"url": server.url, "ok": got.ok, "stderr": got.stderr}
        return AgentResult(turns=1)


def test_an_mcp_server_of_a_compose_sidecar_is_reached_at_the_address_the_agent_is_given(tmp_path: Path):
    toml = """\
        schema_version = "1.4"
        [agent]
        timeout_sec = 60.0
        [verifier]
        timeout_sec = 60.0
        [[environment.mcp_servers]]
        name = "probe"
        transport = "streamable-http"
        url = "http://mcp:8765/mcp/"
        """
    test_sh = '#!/bin/bash\n[ "$(cat /app/answer.txt 2>/dev/null)" = mcp-ok ] && echo 1 > /logs/verifier/reward.txt ' \
              '|| echo 0 > /logs/verifier/reward.txt\n'
    task_dir = write_task(tmp_path, "mcp-sidecar", toml=toml, test_sh=test_sh,
                          files={"environment/Dockerfile": "FROM ubuntu:24.04\nWORKDIR /app\n",
                                 "environment/docker-compose.yaml": COMPOSE})
    task = load_harbor_task(task_dir)
    assert [sv.name for sv in task.sandbox_spec().services] == ["mcp"]
    config = json.loads(mcp_env(task)["MILES_MCP_CONFIG"])
    assert config == {"mcpServers": {"probe": {"type": "http", "url": "http://mcp:8765/mcp/"}}}
    be = backend()
    result = run(run_episode(task, McpProbeAgent(), be))
    assert (result.reward.reward, result.reward.error) == (1.0, None), (result.reward, result.info)
    assert result.info["probe"]["url"] == "http://mcp:8765/mcp/"
    nop = run(run_episode(load_harbor_task(task_dir), NopAgent(), be))
    assert nop.reward.reward == 0.0
    assert containers_of(be.run_id) == [] and leftover("network", be.run_id) == []


def test_an_entrypoint_that_exits_kills_the_sandbox_saying_so(tmp_path: Path):
    (tmp_path / "Dockerfile").write_text('FROM ubuntu:24.04\nENTRYPOINT ["/bin/sh", "-c", "echo booting failed >&2; exit 3"]\n')
    be = backend()

    async def go() -> str:
        try:  # the create's own set-up exec, or a later one, finds the container stopped
            async with await be.create(SandboxSpec(build=BuildContext(context_dir=tmp_path), keep_entrypoint=True)) as sb:
                for _ in range(100):
                    await sb.exec("true", timeout_s=30)
        except SandboxError as exc:
            return str(exc)
        return "the sandbox outlived its exited ENTRYPOINT"

    msg = run(go())
    assert "the image's ENTRYPOINT exited with code 3" in msg and "booting failed" in msg, msg
    assert containers_of(be.run_id) == []

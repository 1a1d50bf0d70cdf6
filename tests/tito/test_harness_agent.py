"""The harness agent inside a local namespace sandbox (its own network namespace): a custom
harness over the per-sandbox forwarder, then the real Claude Code and Codex CLIs (installed by
scripts/install_harnesses.sh; skipped with the reason when absent) against a scripted policy
that calls the harness's shell tool once, then answers. The tool must run in the sandbox, the
session must end with one exact trajectory and zero non-assistant mismatch."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from click.testing import CliRunner

from miles_engine.cli.tito_cmd import tito
from miles_engine.tito.harness import default_harness_dir, harness_bin
from miles_engine.tito.harness_check import check_harness

# A minimal harness: stdlib Python, chat completions with one bash tool, as an agent would.
CUSTOM = r"""
python3 - <<'EOF'
import json, os, socket, subprocess, urllib.request
base = os.environ["MILES_SESSION_URL"] + "/v1/chat/completions"
# the host's loopback is not this sandbox's: only the relay leads out
host_port = int(os.environ.get("MILES_HOST_PORT", "0"))
try:
    if host_port:
        socket.create_connection(("127.0.0.1", host_port), timeout=2).close(); print("LEAK")
except OSError:
    print("isolated")
tool = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object",
        "properties": {"command": {"type": "string"}}}}}
msgs = [{"role": "user", "content": os.environ["MILES_TASK_PROMPT"]}]
for _ in range(4):
    req = urllib.request.Request(base, json.dumps({"messages": msgs, "tools": [tool]}).encode(),
                                 {"content-type": "application/json"})
    msg = json.load(urllib.request.urlopen(req))["choices"][0]["message"]
    msgs.append(msg)
    if not msg.get("tool_calls"):
        break
    for call in msg["tool_calls"]:
        cmd = json.loads(call["function"]["arguments"])["command"]
        out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True).stdout
        msgs.append({"role": "tool", "tool_call_id": call["id"], "content": out})
print(msgs[-1]["content"])
EOF
"""


def _backend_options() -> dict:
    return {"memory_mb": None, "ro_binds": {"/miles/harnesses": default_harness_dir()}}


def _namespace_or_skip():
    from miles_engine.hub import Hub

    backend = Hub().create("sandbox", "local", {})
    if backend.capabilities().isolation != "namespace":
        pytest.skip("the local sandbox has no namespace tier here (bubblewrap/unshare unavailable)")


def _check(summary: dict) -> None:
    assert summary["stop"] == "done", summary
    assert summary["tool_ran"], summary  # the policy's tool call ran inside the sandbox
    assert summary["trajectories"] == 1 and summary["forks"] == 0
    assert summary["turns"] == 2 and summary["generations"] == 2
    assert summary["mismatch"]["non_assistant_text"] == 0
    assert summary["mismatch"]["special_token_count"] == summary["mismatch"]["special_token_type"] == 0
    assert summary["sampled_tokens"] == sum(t["completion_tokens"] for t in summary["per_turn"])


def test_custom_harness_reaches_its_session_only_through_the_forwarder():
    _namespace_or_skip()
    with socket.socket() as host_listener:  # a host loopback port the sandbox must not reach
        host_listener.bind(("127.0.0.1", 0))
        host_listener.listen(1)
        port = host_listener.getsockname()[1]
        [summary] = asyncio.run(check_harness(CUSTOM, sessions=1, backend_options={"memory_mb": None}, timeout_s=60,
                                              env={"MILES_HOST_PORT": str(port)}))
    _check(summary)
    assert "isolated" in summary["stdout_tail"] and "LEAK" not in summary["stdout_tail"]


@pytest.mark.slow
@pytest.mark.parametrize("preset,binary", [("claude-code", "claude"), ("codex", "codex")])
def test_real_cli_harness_in_a_sandbox(preset, binary):
    if harness_bin(binary) is None:
        pytest.skip(f"{binary} not installed in {default_harness_dir()} (run scripts/install_harnesses.sh; "
                    "needs node/npm and the npm registry)")
    _namespace_or_skip()
    [summary] = asyncio.run(check_harness("", sessions=1, preset=preset, backend_options=_backend_options(),
                                          timeout_s=150))
    _check(summary)


def test_check_harness_command_reports_per_session_and_turn_and_fails_on_a_broken_harness():
    _namespace_or_skip()
    ok = CliRunner().invoke(tito, ["check-harness", CUSTOM, "--sessions", "2", "--timeout", "60", "--json"])
    assert ok.exit_code == 0, ok.output
    sessions = json.loads(ok.stdout)
    assert len(sessions) == 2
    for summary in sessions:
        _check(summary)
        assert [t["turn"] for t in summary["per_turn"]] == [1, 2]
    bad = CliRunner().invoke(tito, ["check-harness", "echo giving up >&2; exit 3", "-n", "1", "--timeout", "30"])
    assert bad.exit_code == 1
    assert "harness custom exited with status 3" in bad.output and "giving up" in bad.output


def test_a_sandbox_without_a_route_is_refused_naming_what_it_needs():
    from miles_engine.tito.harness import _route

    class Remote:
        isolation = "container"

    class Routable(Remote):
        async def route_to_host(self, host: str, port: int) -> str:
            return "http://127.0.0.1:1"

    assert _route(Routable()) == "sandbox"
    with pytest.raises(RuntimeError, match=r"cannot route Remote .*route_to_host\(host, port\)"):
        _route(Remote())

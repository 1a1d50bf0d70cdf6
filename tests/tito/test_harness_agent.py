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
from miles_engine.tito.harness import default_harness_dir
from miles_engine.tito.harness_check import check_harness
from miles_engine.hub import default_hub
from tests.tito.harness_kit import check_one_exact_session, custom_harness, require_harness_cli

# First: the host's loopback is not this sandbox's, only the relay leads out.
CUSTOM = custom_harness(r"""
host_port = int(os.environ.get("MILES_HOST_PORT", "0"))
try:
    if host_port:
        socket.create_connection(("127.0.0.1", host_port), timeout=2).close(); print("LEAK")
except OSError:
    print("isolated")
""")


def _backend_options() -> dict:
    return {"memory_mb": None, "ro_binds": {"/miles/harnesses": default_harness_dir()}}


def _namespace_or_skip():
    from miles_engine.hub import Hub

    backend = Hub().create("sandbox", "local", {})
    if backend.capabilities().isolation != "namespace":
        pytest.skip("the local sandbox has no namespace tier here (bubblewrap/unshare unavailable)")


def test_custom_harness_reaches_its_session_only_through_the_forwarder():
    _namespace_or_skip()
    with socket.socket() as host_listener:  # a host loopback port the sandbox must not reach
        host_listener.bind(("127.0.0.1", 0))
        host_listener.listen(1)
        port = host_listener.getsockname()[1]
        [summary] = asyncio.run(check_harness(CUSTOM, sessions=1, backend_options={"memory_mb": None}, timeout_s=60,
                                              env={"MILES_HOST_PORT": str(port)}, hub=default_hub()))
    check_one_exact_session(summary)
    assert "isolated" in summary["stdout_tail"] and "LEAK" not in summary["stdout_tail"]


@pytest.mark.slow
@pytest.mark.parametrize("preset,binary", [("claude-code", "claude"), ("codex", "codex")])
def test_real_cli_harness_in_a_sandbox(preset, binary):
    require_harness_cli(binary)
    _namespace_or_skip()
    [summary] = asyncio.run(check_harness("", sessions=1, preset=preset, backend_options=_backend_options(),
                                          timeout_s=150, hub=default_hub()))
    check_one_exact_session(summary)


def test_check_harness_command_reports_per_session_and_turn_and_fails_on_a_broken_harness():
    _namespace_or_skip()
    ok = CliRunner().invoke(tito, ["check-harness", CUSTOM, "--sessions", "2", "--timeout", "60", "--json"])
    assert ok.exit_code == 0, ok.output
    sessions = json.loads(ok.stdout)
    assert len(sessions) == 2
    for summary in sessions:
        check_one_exact_session(summary)
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

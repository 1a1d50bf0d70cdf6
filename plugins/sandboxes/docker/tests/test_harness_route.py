"""The harness agent in a real docker container (``scripts/container_engine.sh start``; skipped
with the reason without one): its per-episode route reaches the session server and nothing
else, then the real Codex and Claude Code CLIs (their npm packages' native binaries,
bind-mounted read-only; skipped when scripts/install_harnesses.sh has not run) drive their
session from inside the container against a scripted policy that calls their shell tool once,
then answers: the tool ran in the container, one exact trajectory, zero non-assistant mismatch,
no container, network or route directory left."""

from __future__ import annotations

import asyncio
import glob
import secrets
import socket
import subprocess

import pytest

from miles_engine.sandbox.protocol import RUN_LABEL
from miles_engine.tito.harness import default_harness_dir
from miles_engine.tito.harness_check import check_harness
from miles_sandbox_docker.options import DockerSandboxOptions
from miles_sandbox_docker.standins import StandInMap
from tests.tito.harness_kit import check_one_exact_session, custom_harness, require_harness_cli
from miles_engine.hub import default_hub

pytestmark = pytest.mark.timeout(400)

# Inside the container, first: the host (its address and loopback ports) and the internet are out of reach.
CUSTOM = custom_harness(r"""
for name, host, port in [("host", os.environ["MILES_HOST_IP"], int(os.environ["MILES_HOST_PORT"])),
                         ("loopback", "127.0.0.1", int(os.environ["MILES_HOST_PORT"])),
                         ("internet", "1.1.1.1", 443)]:
    try:
        socket.create_connection((host, port), timeout=3).close(); print("LEAK", name)
    except OSError:
        print("isolated", name)
print("interfaces", " ".join(sorted(os.listdir("/sys/class/net"))))
""")


@pytest.fixture(scope="module", autouse=True)
def _engine(real_docker: str | None) -> None:
    if real_docker is not None:
        pytest.skip(f"{real_docker} (start one with scripts/container_engine.sh start)")
    opts = DockerSandboxOptions()
    stand_ins = StandInMap.build(opts.stand_ins, opts.stand_in_families, defaults=opts.stand_in_defaults)
    for ref in ("ubuntu:24.04", opts.route_image):
        image = opts.image_map.get(ref, ref)
        if stand_ins.match(image) and subprocess.run(["docker", "image", "inspect", image], capture_output=True,
                                                     timeout=30).returncode:
            image = opts.stand_in_base  # the backend builds the stand-in family from it
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=30).returncode:
            pytest.skip(f"no local image for {ref} (scripts/container_engine.sh start builds one and maps it)")


def _left_behind(run_id: str) -> tuple[list[str], list[str]]:
    def ls(*args: str) -> list[str]:
        return subprocess.run(["docker", *args, "--filter", f"label={RUN_LABEL}={run_id}"], capture_output=True,
                              text=True, timeout=60, check=True).stdout.split()

    return ls("ps", "--all", "--quiet") + ls("network", "ls", "--quiet"), glob.glob("/tmp/miles-route-sbx-*")


def _host_ip() -> str:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect(("10.255.255.255", 9))  # no packet is sent: this only picks the outgoing interface
    try:
        return probe.getsockname()[0]
    finally:
        probe.close()


def test_custom_harness_reaches_its_session_server_and_nothing_else():
    run_id = "route-" + secrets.token_hex(3)
    routes_before = set(glob.glob("/tmp/miles-route-sbx-*"))
    with socket.socket() as listener:  # a host port on every address (its loopback too): the container reaches none
        listener.bind(("0.0.0.0", 0))
        listener.listen(8)
        listener.setblocking(False)
        port = listener.getsockname()[1]

        [summary] = asyncio.run(check_harness(
            CUSTOM, sessions=1, backend="docker", timeout_s=120, backend_options={"run_id": run_id},
            env={"MILES_HOST_IP": _host_ip(), "MILES_HOST_PORT": str(port)}, hub=default_hub()))
        with pytest.raises(BlockingIOError):
            listener.accept()
    check_one_exact_session(summary)
    out = summary["stdout_tail"]
    for name in ("host", "loopback", "internet"):
        assert f"isolated {name}" in out and f"LEAK {name}" not in out, out
    assert "interfaces lo" in out.splitlines(), out  # network mode none: loopback only
    containers, _ = _left_behind(run_id)
    assert containers == []
    assert set(glob.glob("/tmp/miles-route-sbx-*")) <= routes_before


@pytest.mark.slow
@pytest.mark.parametrize("preset,binary", [("codex", "codex"), ("claude-code", "claude")])
def test_real_cli_harness_in_a_container(preset, binary):
    require_harness_cli(binary)
    run_id = "route-" + secrets.token_hex(3)
    [summary] = asyncio.run(check_harness(
        "", sessions=1, preset=preset, backend="docker", timeout_s=150,
        backend_options={"run_id": run_id, "ro_binds": {"/miles/harnesses": default_harness_dir()}}, hub=default_hub()))
    check_one_exact_session(summary)
    assert _left_behind(run_id)[0] == []

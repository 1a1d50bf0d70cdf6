"""Sidecar services and compose tasks on a real container engine (the set-up and skip of
test_real_engine.py): a sidecar healthy before the main container starts, reached by name on an
internal network that reaches nothing outside; one that never gets healthy fails naming it;
compose ``depends_on`` conditions, shared volumes, limits applied and ports never published;
nothing of the sandbox (containers, volumes, networks) left afterwards."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from miles_engine.errors import SandboxError
from miles_engine.sandbox.protocol import SandboxSpec, ServiceSpec

from .real_engine import ENGINE, backend, containers_of, leftover, run

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("real_engine")]


def test_sidecar_on_an_internal_network_healthy_first_and_removed_after():
    be = backend()
    server = ServiceSpec(
        name="server", image="ubuntu:24.04", command=("python3", "-m", "http.server", "8000", "--directory", "/etc"),
        healthcheck=("python3", "-c", "import urllib.request; urllib.request.urlopen('http://localhost:8000/hostname')"),
    )

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect(("10.255.255.255", 9))  # no packet is sent: this only picks the outgoing interface
    host_ip = probe.getsockname()[0]
    probe.close()
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))  # every host address, the network's gateway (if it has one) too
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]

    async def go():
        async with await be.create(SandboxSpec(services=(server,))) as sb:
            got = await sb.exec("python3 -c \"import urllib.request; print(urllib.request.urlopen("
                                "'http://server:8000/hostname', timeout=10).read().decode().strip())\"", timeout_s=30)
            info = json.loads(subprocess.run([ENGINE, "network", "inspect", sb.network], capture_output=True,
                                             text=True, timeout=60, check=True).stdout)[0]
            gateways = [c.get("Gateway") for c in (info.get("IPAM") or {}).get("Config") or []]  # docker
            gateways += [c.get("gateway") for c in info.get("subnets") or []]  # podman
            out = await sb.exec("; ".join(f"timeout 5 bash -c 'exec 3<>/dev/tcp/{ip}/{port}' && echo OPEN {ip}"
                                          for ip in [host_ip, *filter(None, gateways)]), timeout_s=60)
            return got, out, sb.network

    got, out, network = run(go())
    try:
        listener.accept()
        accepted = True
    except BlockingIOError:
        accepted = False
    finally:
        listener.close()
    assert got.ok and got.stdout.strip() == "server", got  # first request answered: it was healthy before
    assert "OPEN" not in out.stdout and not accepted  # --internal: nothing outside the network is reached
    assert containers_of(be.run_id) == []
    nets = subprocess.run([ENGINE, "network", "ls", "--quiet", "--filter", f"name={network}"],
                          capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert nets == []


def test_sidecar_that_never_gets_healthy_fails_naming_it():
    be = backend()
    bad = ServiceSpec(name="db", image="ubuntu:24.04", command=("sleep", "600"), healthcheck=("false",),
                      ready_timeout_s=3)
    with pytest.raises(SandboxError, match=r"service 'db' not healthy within 3s \(healthcheck 'false'"):
        run(be.create(SandboxSpec(services=(bad,))))
    assert containers_of(be.run_id) == []


COMPOSE_ORDERED = """\
services:
  client:
    depends_on: {api: {condition: service_healthy}}
    volumes: ["shared:/shared"]
  init:
    image: ubuntu:24.04
    command: ["/bin/sh", "-c", "sleep 1; cat /seed/word > /data/word; echo INIT_EXIT"]
    volumes: ["shared:/data", "./seed:/seed:ro"]
  api:
    image: ubuntu:24.04
    depends_on: {init: {condition: service_completed_successfully}}
    # serves what init left in the shared volume; fails at once if init had not finished first
    command: ["/bin/sh", "-c", "test -s /data/word && exec python3 -m http.server 8000 --directory /data"]
    volumes: [{type: volume, source: shared, target: /data, read_only: true}]
    healthcheck: {test: ["CMD", "python3", "-c", "import urllib.request; urllib.request.urlopen('http://localhost:8000/word')"]}
"""


def test_compose_depends_on_order_and_shared_volumes(tmp_path: Path):
    from miles_engine.sandbox.compose import load_services

    (tmp_path / "seed").mkdir()
    (tmp_path / "seed" / "word").write_text("ordered\n")
    compose = tmp_path / "docker-compose.yaml"
    compose.write_text(COMPOSE_ORDERED)
    loaded = load_services(compose, main="client")
    spec = SandboxSpec(services=loaded.sidecars, volumes=loaded.main_volumes)
    be = backend()

    async def go():
        async with await be.create(spec) as sb:
            got = await sb.exec("cat /shared/word; python3 -c \"import urllib.request; print(urllib.request.urlopen("
                                "'http://api:8000/word', timeout=10).read().decode().strip())\"", timeout_s=30)
            ro = await sb.exec("touch /shared/x && echo WROTE", timeout_s=30)
            return got, ro, list(sb.volumes)

    got, ro, vols = run(go())
    assert got.ok and got.stdout.split() == ["ordered", "ordered"], got
    assert ro.ok and "WROTE" in ro.stdout  # the client's own mount is read-write; api's is read-only
    assert len(vols) == 1 and containers_of(be.run_id) == []
    assert leftover("volume", be.run_id) == []

    # a one-shot service that fails stops the sandbox's creation, naming it and its exit code
    compose.write_text(COMPOSE_ORDERED.replace("echo INIT_EXIT", "exit 3"))
    bad = load_services(compose, main="client")
    with pytest.raises(SandboxError, match=r"service 'init' exited with code 3 \(service_completed_successfully\)"):
        run(be.create(SandboxSpec(services=bad.sidecars, volumes=bad.main_volumes)))
    assert containers_of(be.run_id) == []
    assert leftover("volume", be.run_id) == []


COMPOSE_LIMITED = """\
services:
  client:
    cpus: 1.5
    mem_limit: 300m
    ports: ["18080:8080"]
  api:
    image: ubuntu:24.04
    command: ["python3", "-m", "http.server", "8000", "--directory", "/etc"]
    ports: ["18000:8000"]
    deploy: {resources: {limits: {cpus: '0.5', memory: 64M, pids: 50}}}
    healthcheck: {test: ["CMD", "python3", "-c", "import urllib.request; urllib.request.urlopen('http://localhost:8000/hostname')"]}
"""


def test_compose_limits_applied_and_ports_not_published(tmp_path: Path):
    from miles_engine.sandbox.compose import load_services

    compose = tmp_path / "docker-compose.yaml"
    compose.write_text(COMPOSE_LIMITED)
    loaded = load_services(compose, main="client")
    spec = SandboxSpec(services=loaded.sidecars, resources=loaded.main_limits.resources)
    be = backend(pids_limit=200)

    def inspect(container: str) -> dict:
        res = subprocess.run([ENGINE, "container", "inspect", container], capture_output=True, text=True,
                             timeout=60, check=True)
        return json.loads(res.stdout)[0]

    async def go():
        async with await be.create(spec) as sb:
            got = await sb.exec("python3 -c \"import urllib.request; print(urllib.request.urlopen("
                                "'http://api:8000/hostname', timeout=10).read().decode().strip())\"", timeout_s=30)
            return got, inspect(f"miles-{sb.id}-api"), inspect(sb.container)

    got, api, client = run(go())
    assert got.ok and got.stdout.strip() == "api", got  # reached by name on its own port
    host = api["HostConfig"]
    assert (host["NanoCpus"], host["Memory"], host["PidsLimit"]) == (500_000_000, 64 << 20, 50)
    assert (client["HostConfig"]["NanoCpus"], client["HostConfig"]["Memory"]) == (1_500_000_000, 300 << 20)
    assert client["HostConfig"]["PidsLimit"] == 200  # the backend's own limit
    for info in (api, client):  # nothing published on the host
        assert not info["HostConfig"].get("PortBindings")
        assert not any((info["NetworkSettings"].get("Ports") or {}).values())
    assert containers_of(be.run_id) == []

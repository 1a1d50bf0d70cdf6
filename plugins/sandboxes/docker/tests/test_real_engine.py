"""The docker backend against a real container engine (``scripts/container_engine.sh start``
provides one: a private dockerd and a base image made from Debian packages, with the image
map ``ubuntu:24.04 -> miles-base:bookworm``). Skipped, with the reason, where none answers.

Covered: the hostile-command suite; a fork bomb at the pids limit stopped without losing the
sandbox; memory limit; Dockerfile builds cached by content, a build needing the network with
none allowed failing at its step; Harbor, terminal-bench and compose tasks built from their
own directories (oracle 1.0, no-op 0.0 through ``miles env validate``); a SIGKILLed run's
containers swept by the next start and by ``miles sandbox sweep``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from miles_engine.cli.main import main
from miles_engine.errors import SandboxError
from miles_engine.sandbox.hostile import run_hostile_suite
from miles_engine.sandbox.protocol import RUN_LABEL, BuildContext, Resources, SandboxSpec, ServiceSpec
from miles_sandbox_docker.backend import DockerSandboxBackend
from miles_sandbox_docker.options import DockerSandboxOptions

TASKS = Path(__file__).with_name("tasks")
ENGINE = os.environ.get("MILES_DOCKER_BINARY") or "docker"  # the engine CLI under test (docker or podman)
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", autouse=True)
def _engine(real_docker: str | None) -> None:
    if real_docker is not None:
        pytest.skip(f"{real_docker} (start one with scripts/container_engine.sh start)")
    mapped = DockerSandboxOptions().image_map.get("ubuntu:24.04")
    probe = subprocess.run([ENGINE, "image", "inspect", mapped or "ubuntu:24.04"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip("no local image for ubuntu:24.04 and no image map for it (MILES_DOCKER_IMAGE_MAP; "
                    "scripts/container_engine.sh start builds one)")


def run(coro, timeout: float = 240.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def backend(**opts) -> DockerSandboxBackend:
    return DockerSandboxBackend(DockerSandboxOptions(run_id=opts.pop("run_id", "real-" + secrets.token_hex(3)), **opts))


def containers_of(run_id: str) -> list[str]:
    res = subprocess.run([ENGINE, "ps", "--all", "--quiet", "--filter", f"label={RUN_LABEL}={run_id}"],
                         capture_output=True, text=True, timeout=60, check=True)
    return res.stdout.split()


def exit_code(*argv: str) -> int:
    try:
        main(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


# ------------------------------------------------------------------ isolation and limits
@pytest.mark.slow
def test_hostile_suite_contained():
    be = backend()

    async def go():
        try:
            return await run_hostile_suite(be, concurrency=1)
        finally:
            await be.aclose()

    results = run(go())
    assert [r.case for r in results if not r.contained] == [], [(r.case, r.duration_s, r.detail) for r in results]
    assert all(r.leftover_processes == 0 for r in results)  # observable here: the engine is local
    assert containers_of(be.run_id) == []


def test_fork_bomb_at_the_pids_limit_is_stopped_and_the_sandbox_lives():
    be = backend(pids_limit=256)

    async def go():
        async with await be.create(SandboxSpec()) as sb:
            bomb = await sb.exec("b() { b | b & }; b; sleep 600", timeout_s=3)
            after = await sb.exec("echo alive; ls /proc | grep -c '^[0-9]'", timeout_s=60)
            return bomb, after, sb

    try:
        bomb, after, sb = run(go())
    except SandboxError as exc:
        # podman: when no exec fits under the limit to stop the bomb's tree from inside, the
        # container is killed instead: still contained, the sandbox reported dead, nothing left
        assert be.cli.engine_name() == "podman", exc
        assert "is dead: its container was killed: a timed-out command" in str(exc), exc
        assert containers_of(be.run_id) == []
        return
    assert bomb.timed_out and bomb.exit_code is None
    assert after.ok and after.stdout.split()[0] == "alive" and int(after.stdout.split()[1]) < 10, after
    assert sb.leftover_processes() == [] and containers_of(be.run_id) == []


def test_memory_limit_holds():
    be = backend()

    async def go():
        async with await be.create(SandboxSpec(resources=Resources(memory_mb=64))) as sb:
            return await sb.exec("python3 -c 'b = bytearray(256 << 20); print(len(b))'", timeout_s=60)

    res = run(go())
    assert res.exit_code not in (0, None) and "268435456" not in res.stdout, res


def test_network_none_has_no_route_out():
    be = backend()

    async def go():
        async with await be.create(SandboxSpec()) as sb:
            return await sb.exec("cat /proc/net/route | wc -l; ls /sys/class/net", timeout_s=30)

    res = run(go())
    lines = res.stdout.split()
    assert res.ok and lines[0] == "1" and lines[1:] == ["lo"], res  # only the header: no routes, only loopback


# ------------------------------------------------------------------ images
def test_build_is_cached_by_content_and_from_lines_are_mapped(tmp_path: Path):
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(f"FROM ubuntu:24.04\nRUN echo {secrets.token_hex(4)} > /built\n")
    be = backend()

    async def go():
        out = []
        for _ in range(2):
            async with await be.create(SandboxSpec(build=BuildContext(context_dir=ctx))) as sb:
                out.append((await sb.exec("cat /built /etc/debian_version", timeout_s=30)).stdout.split())
        return out

    first, second = run(go())
    assert first == second and len(first) == 2
    stats = be.stats()
    assert stats["sandbox/builds"] == 1 and stats["sandbox/build_cache_hits"] == 1
    assert stats["sandbox/create_n"] == 2 and stats["sandbox/destroy_n"] == 2 and stats["sandbox/exec_n"] == 2
    step = be.step_metrics()  # what the training log gets for a step: since the last call
    assert (step["sandbox/builds"], step["sandbox/build_cache_hits"], step["sandbox/create_n"]) == (1, 1, 2)
    assert 0 < step["sandbox/create_p50_s"] <= step["sandbox/create_p95_s"] and step["sandbox/destroy_p50_s"] > 0
    nothing = be.step_metrics()
    assert nothing["sandbox/builds"] == nothing["sandbox/exec_n"] == 0 and "sandbox/exec_p50_s" not in nothing
    assert (ctx / "Dockerfile").read_text().startswith("FROM ubuntu:24.04")  # the task dir is not modified


def test_build_needing_the_network_fails_at_its_step_when_none_is_allowed(tmp_path: Path):
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(
        f"FROM ubuntu:24.04\nRUN echo {secrets.token_hex(4)}\nRUN apt-get update && apt-get install -y cowsay\n"
    )
    be = backend(build_network="none", build_timeout_s=180)
    with pytest.raises(SandboxError) as exc:
        run(be.create(SandboxSpec(build=BuildContext(context_dir=ctx))))
    msg = str(exc.value)
    assert re.search(r"at step 3/\d+: RUN apt-get update && apt-get install -y cowsay", msg), msg
    assert "build_network='none'" in msg and "did not answer" not in msg
    left = subprocess.run([ENGINE, "ps", "--all", "--quiet", "--filter", "status=exited"], capture_output=True,
                          text=True, timeout=60, check=True).stdout.split()
    assert left == []  # no intermediate container of the failed step


# ------------------------------------------------------------------ tasks from their directories
@pytest.mark.parametrize("env_name", ["harbor", "terminal-bench"])
def test_tasks_validate_from_their_own_directories(env_name: str, capsys):
    path = TASKS / env_name
    code = exit_code("env", "validate", env_name, "--path", str(path), "--backend", "docker", "--json", "--jobs", "2")
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    expected = sorted(p.name for p in path.iterdir() if p.is_dir())
    assert sorted(t["task"] for t in report["tasks"]) == expected
    assert all(t["oracle_reward"] == 1.0 and t["nop_reward"] == 0.0 for t in report["tasks"]), report


# ------------------------------------------------------------------ lifecycle
CHILD = textwrap.dedent("""
    import asyncio, sys
    from miles_engine.sandbox.protocol import SandboxSpec
    from miles_sandbox_docker.backend import DockerSandboxBackend
    from miles_sandbox_docker.options import DockerSandboxOptions

    async def main():
        be = DockerSandboxBackend(DockerSandboxOptions(run_id=sys.argv[1]))
        sbs = [await be.create(SandboxSpec()) for _ in range(2)]
        print(" ".join(sb.id for sb in sbs), flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
""")


def start_and_sigkill(run_id: str) -> list[str]:
    """A miles process creates two sandboxes and is SIGKILLed: its containers stay behind."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, run_id], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ))
    try:
        line = child.stdout.readline()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert len(line.split()) == 2, f"child printed {line!r}"
    left = containers_of(run_id)
    assert len(left) == 2
    return left


def test_sigkilled_run_is_swept_by_the_next_start():
    dead_run = "killed-" + secrets.token_hex(3)
    start_and_sigkill(dead_run)
    be = backend()

    async def go():
        async with await be.create(SandboxSpec()):
            return containers_of(dead_run)

    assert run(go()) == []


def test_sandbox_sweep_command_removes_a_runs_containers(capsys):
    dead_run = "swept-" + secrets.token_hex(3)
    start_and_sigkill(dead_run)
    code = exit_code("sandbox", "sweep", "--backend", "docker", "--option", "sweep_orphans=false",
                     "--run", dead_run, "--json")
    assert code == 0 and len(json.loads(capsys.readouterr().out)) == 2
    assert containers_of(dead_run) == []


def test_concurrency_limit_holds_on_the_engine():
    be = backend(max_sandboxes=2, max_creates_per_s=20)

    async def go():
        first, second = await be.create(SandboxSpec()), await be.create(SandboxSpec())
        third = asyncio.ensure_future(be.create(SandboxSpec()))
        await asyncio.sleep(1.0)
        waited = not third.done()  # a slot frees only when a sandbox closes
        await first.close()
        sb3 = await asyncio.wait_for(third, 120)
        await asyncio.gather(second.close(), sb3.close())
        return waited

    assert run(go())
    assert be.stats()["sandbox/create_n"] == 3 and containers_of(be.run_id) == []


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
    left = subprocess.run([ENGINE, "volume", "ls", "--quiet", "--filter", f"label={RUN_LABEL}={be.run_id}"],
                          capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert left == []

    # a one-shot service that fails stops the sandbox's creation, naming it and its exit code
    compose.write_text(COMPOSE_ORDERED.replace("echo INIT_EXIT", "exit 3"))
    bad = load_services(compose, main="client")
    with pytest.raises(SandboxError, match=r"service 'init' exited with code 3 \(service_completed_successfully\)"):
        run(be.create(SandboxSpec(services=bad.sidecars, volumes=bad.main_volumes)))
    assert containers_of(be.run_id) == []
    left = subprocess.run([ENGINE, "volume", "ls", "--quiet", "--filter", f"label={RUN_LABEL}={be.run_id}"],
                          capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert left == []


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

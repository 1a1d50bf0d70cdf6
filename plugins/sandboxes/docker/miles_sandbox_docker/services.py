"""Sidecar services (Docker Compose services besides the agent's container).

A sandbox with services gets its own network ``miles-net-<sandbox id>`` (``--internal`` and no
host address on its bridge when the spec's network mode is ``none``: the services are
reachable, the internet and the host are not), each
service a container on it reachable by its name, started and healthy (its healthcheck exits
0) before the sandbox is handed out. Network and containers carry the run, sandbox and owner
labels, and go with the sandbox (``close``, ``sweep``, the orphan sweep).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from miles_engine.errors import SandboxError
from miles_engine.sandbox.protocol import SandboxSpec, ServiceSpec

from miles_sandbox_docker.cli import NoSuchContainer, classify

if TYPE_CHECKING:
    from miles_sandbox_docker.backend import DockerSandboxBackend
    from miles_sandbox_docker.sandbox import DockerSandbox

SERVICE_LABEL = "miles.service"


async def create_network(be: DockerSandboxBackend, sb: DockerSandbox, labels: dict[str, str]) -> str:
    name = f"miles-net-{sb.id}"
    args = ["network", "create"]
    if sb.spec.network.mode == "none":
        # --internal stops forwarding out of the network, but the host's own addresses stay
        # reachable through the bridge's gateway address; without one (inhibit_ipv4) they are not.
        args += ["--internal"]
        if be.cli.engine_name() == "docker":
            args += ["--opt", "com.docker.network.bridge.inhibit_ipv4=true"]
    for key, value in labels.items():
        args += ["--label", f"{key}={value}"]
    await be.cli.run([*args, name], what=f"create network of sandbox {sb.id}")
    return name


async def start_services(be: DockerSandboxBackend, sb: DockerSandbox, network: str, labels: dict[str, str],
                         run_id: str) -> None:
    """Start every service of ``sb.spec`` on ``network`` and wait until each is healthy."""
    for svc in sb.spec.services:
        image = await be.image_for(SandboxSpec(image=svc.image, build=svc.build, paths=()), run_id)
        container = f"miles-{sb.id}-{svc.name}"
        args = ["run", "--detach", "--rm", "--pull", "never", "--name", container,
                "--network", network, "--network-alias", svc.name, "--hostname", svc.name[:63]]
        for key, value in {**labels, SERVICE_LABEL: svc.name}.items():
            args += ["--label", f"{key}={value}"]
        for key, value in svc.env.items():
            args += ["--env", f"{key}={value}"]
        if be.options.pids_limit:
            args += ["--pids-limit", str(be.options.pids_limit)]
        args += [image, *(svc.command or ())]
        sb.service_containers.append(container)
        await be.cli.run(args, what=f"start service '{svc.name}' of sandbox {sb.id}")
    await asyncio.gather(*(wait_healthy(be, sb, svc) for svc in sb.spec.services))


async def wait_healthy(be: DockerSandboxBackend, sb: DockerSandbox, svc: ServiceSpec) -> None:
    container = f"miles-{sb.id}-{svc.name}"
    deadline = time.monotonic() + svc.ready_timeout_s
    delay = 0.2
    last = ""
    while True:
        running = await be.cli.run(["container", "inspect", "--format", "{{.State.Running}}", container],
                                   what=f"inspect service '{svc.name}'", check=False)
        if running.rc != 0 or running.stdout.strip() != b"true":
            raise SandboxError(f"sandbox {sb.id}: service '{svc.name}' exited before it was healthy"
                               + await _logs_tail(be, container))
        if svc.healthcheck is None:
            return
        probe = await be.cli.run(["exec", container, *svc.healthcheck], what=f"healthcheck of '{svc.name}'",
                                 check=False, timeout_s=max(1.0, min(30.0, deadline - time.monotonic())))
        if probe.rc == 0:
            return
        last = (probe.err or probe.stdout.decode(errors="replace")).strip()[-300:]
        if time.monotonic() + delay > deadline:
            raise SandboxError(
                f"sandbox {sb.id}: service '{svc.name}' not healthy within {svc.ready_timeout_s:g}s "
                f"(healthcheck {' '.join(svc.healthcheck)!r}: {last or 'exit ' + str(probe.rc)})"
            )
        await asyncio.sleep(delay)
        delay = min(2.0, delay * 1.5)


async def _logs_tail(be: DockerSandboxBackend, container: str) -> str:
    res = await be.cli.run(["logs", "--tail", "20", container], what="service logs", check=False)
    text = (res.stdout.decode(errors="replace") + res.err).strip()
    return f"; its last output:\n{text}" if text else ""


async def remove_services(be: DockerSandboxBackend, sb: DockerSandbox) -> None:
    """Remove the service containers and the network (missing ones are fine)."""
    if sb.service_containers:
        res = await be.cli.run(["rm", "--force", "--volumes", *sb.service_containers],
                               what=f"remove services of sandbox {sb.id}", check=False)
        if res.rc != 0 and not isinstance(classify("rm", res.err), NoSuchContainer):
            raise classify(f"remove services of sandbox {sb.id}", res.err)
    if sb.network:
        await remove_networks(be, [sb.network])


async def remove_networks(be: DockerSandboxBackend, names: list[str]) -> None:
    for name in names:
        res = await be.cli.run(["network", "rm", name], what=f"remove network {name}", check=False)
        if res.rc != 0 and "not found" not in res.err.lower() and "no such network" not in res.err.lower():
            raise classify(f"remove network {name}", res.err)


async def networks_labelled(be: DockerSandboxBackend, label: str) -> list[tuple[str, str]]:
    """(name, owner label) of the networks carrying ``label`` (``key=value``)."""
    from miles_sandbox_docker.lifecycle import OWNER_LABEL

    res = await be.cli.run(["network", "ls", "--filter", f"label={label}", "--format",
                            '{{.Name}}\t{{.Label "' + OWNER_LABEL + '"}}'], what="list networks", check=False)
    if res.rc != 0:
        return []
    out = []
    for line in res.stdout.decode().splitlines():
        name, _, owner = line.strip().partition("\t")
        if name:
            out.append((name, owner))
    return out

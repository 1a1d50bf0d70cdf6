"""Sidecar services (Docker Compose services besides the agent's container).

Named compose volumes are engine volumes ``miles-vol-<sandbox id>-<name>``, labelled like the
rest and removed with the sandbox. A sandbox with services gets its own network ``miles-net-<sandbox id>`` (``--internal`` and no
host address on its bridge when the spec's network mode is ``none``: the services are
reachable, the internet and the host are not), each
service a container on it reachable by its name, started and healthy (its healthcheck exits
0) before the sandbox is handed out; ``depends_on`` orders the services (started / healthy /
completed successfully). Network and containers carry the run, sandbox and owner
labels, and go with the sandbox (``close``, ``sweep``, the orphan sweep). Each service container
gets its compose limits (cpus, memory, pids) and publishes no port on the host.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from miles_engine.errors import SandboxError
from miles_engine.sandbox.compose import start_order
from miles_engine.sandbox.protocol import SandboxSpec, ServiceSpec, VolumeMount
from miles_engine.sandbox.remote import TransientError

from miles_sandbox_docker import podman_net
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
        elif not be.podman_firewall_checked:  # podman keeps a gateway address: see podman_net
            await asyncio.to_thread(podman_net.refuse_unless_ready, [s.name for s in sb.spec.services])
            be.podman_firewall_checked = True
    for key, value in labels.items():
        args += ["--label", f"{key}={value}"]
    await be.cli.run([*args, name], what=f"create network of sandbox {sb.id}")
    return name


async def create_volumes(be: DockerSandboxBackend, sb: DockerSandbox, labels: dict[str, str]) -> None:
    """One engine volume per volume name the sandbox's containers mount (``miles-vol-<id>-<name>``)."""
    names = sorted({v.source for v in (*sb.spec.volumes, *(m for s in sb.spec.services for m in s.volumes))
                    if v.source and not v.is_bind})
    for name in names:
        volume = f"miles-vol-{sb.id}-{name}"
        args = ["volume", "create"]
        for key, value in labels.items():
            args += ["--label", f"{key}={value}"]
        sb.volumes.append(volume)
        await be.cli.run([*args, volume], what=f"create volume '{name}' of sandbox {sb.id}")


def volume_args(sandbox_id: str, mounts: tuple[VolumeMount, ...]) -> list[str]:
    """``--volume`` arguments for a container of sandbox ``sandbox_id``."""
    args: list[str] = []
    for m in mounts:
        source = m.source if m.is_bind or not m.source else f"miles-vol-{sandbox_id}-{m.source}"
        spec = f"{source}:{m.target}" if source else m.target
        args += ["--volume", spec + (":ro" if m.read_only and source else "")]
    return args


def main_waits_for(spec: SandboxSpec, svc: ServiceSpec) -> str:
    """The condition the agent's container waits for on ``svc`` (see ServiceSpec.main_waits_for)."""
    if svc.main_waits_for:
        return svc.main_waits_for
    if any(other.depends_on.get(svc.name) == "service_completed_successfully" for other in spec.services):
        return "service_completed_successfully"
    return "service_healthy" if svc.healthcheck is not None else "service_started"


async def start_services(be: DockerSandboxBackend, sb: DockerSandbox, network: str, labels: dict[str, str],
                         run_id: str) -> None:
    """Start every service of ``sb.spec`` on ``network``, each once its ``depends_on`` conditions
    hold, and wait for what the agent's container waits for on each."""
    order = start_order(sb.spec.services, where=f"sandbox {sb.id}")
    by_name = {svc.name: svc for svc in order}
    for svc in order:
        unknown = sorted(set(svc.depends_on) - set(by_name))
        if unknown:
            raise SandboxError(f"sandbox {sb.id}: service '{svc.name}' depends on unknown service(s) {unknown}")
    started: dict[str, asyncio.Task[None]] = {}
    reached: dict[tuple[str, str], asyncio.Task[None]] = {}

    async def reach(name: str, cond: str) -> None:
        await started[name]
        if cond == "service_healthy":
            await wait_healthy(be, sb, by_name[name])
        elif cond == "service_completed_successfully":
            await wait_completed(be, sb, by_name[name])
        elif cond == "running":
            await wait_healthy(be, sb, by_name[name])  # without a healthcheck: only that it did not exit

    def condition(name: str, cond: str) -> asyncio.Task[None]:
        if (name, cond) not in reached:
            reached[name, cond] = asyncio.ensure_future(reach(name, cond))
        return reached[name, cond]

    async def start(svc: ServiceSpec) -> None:
        await asyncio.gather(*(condition(dep, cond) for dep, cond in svc.depends_on.items()))
        await run_service(be, sb, svc, network, labels, run_id)

    try:
        for svc in order:
            started[svc.name] = asyncio.ensure_future(start(svc))
        waits = {svc.name: main_waits_for(sb.spec, svc) for svc in order}
        await asyncio.gather(*(condition(name, "running" if cond == "service_started" and by_name[name].main_waits_for
                                         is None else cond) for name, cond in waits.items()))
    finally:
        pending = [t for t in (*started.values(), *reached.values()) if not t.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in (*started.values(), *reached.values()):
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: the first failure was raised above


async def run_service(be: DockerSandboxBackend, sb: DockerSandbox, svc: ServiceSpec, network: str,
                      labels: dict[str, str], run_id: str) -> None:
    image = await be.image_for(SandboxSpec(image=svc.image, build=svc.build, paths=()), run_id)
    container = f"miles-{sb.id}-{svc.name}"
    # no --rm: a one-shot service's exit code is read after it exits; removed with the sandbox
    args = ["run", "--detach", "--pull", "never", "--name", container,
            "--network", network, "--network-alias", svc.name, "--hostname", svc.name[:63]]
    for key, value in {**labels, SERVICE_LABEL: svc.name}.items():
        args += ["--label", f"{key}={value}"]
    for key, value in svc.env.items():
        args += ["--env", f"{key}={value}"]
    args += limit_args(be, svc)
    args += volume_args(sb.id, svc.volumes)
    args += [image, *(svc.command or ())]
    sb.service_containers.append(container)
    await be.cli.run(args, what=f"start service '{svc.name}' of sandbox {sb.id}")


def limit_args(be: DockerSandboxBackend, svc: ServiceSpec) -> list[str]:
    """The service's compose limits: its cpus (else the backend's default), memory (swap
    included) and pids, the last never above the backend's own pids limit."""
    o, res = be.options, svc.resources
    args: list[str] = []
    cpus = res.cpus or o.default_cpus
    if cpus:
        args += ["--cpus", f"{cpus:g}"]
    if res.memory_mb:
        args += ["--memory", f"{res.memory_mb}m", "--memory-swap", f"{res.memory_mb}m"]
    pids = min(p for p in (svc.pids_limit, o.pids_limit) if p) if svc.pids_limit or o.pids_limit else None
    if pids:
        args += ["--pids-limit", str(pids)]
    return args


async def wait_completed(be: DockerSandboxBackend, sb: DockerSandbox, svc: ServiceSpec) -> None:
    """Wait until the service's container exits; an exit code other than 0 is an error."""
    container = f"miles-{sb.id}-{svc.name}"
    try:
        res = await be.cli.run(["wait", container], what=f"wait for service '{svc.name}'",
                               timeout_s=svc.ready_timeout_s)
    except TransientError:
        raise SandboxError(f"sandbox {sb.id}: service '{svc.name}' did not complete within "
                           f"{svc.ready_timeout_s:g}s (service_completed_successfully)") from None
    code = res.stdout.decode().strip().splitlines()[-1:] or ["?"]
    if code[0] != "0":
        raise SandboxError(f"sandbox {sb.id}: service '{svc.name}' exited with code {code[0]} "
                           f"(service_completed_successfully)" + await _logs_tail(be, container))


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
    await remove_volumes(be, sb.volumes)


async def remove_volumes(be: DockerSandboxBackend, names: list[str]) -> None:
    if names:
        res = await be.cli.run(["volume", "rm", "--force", *names], what="remove volumes", check=False)
        if res.rc != 0 and "no such volume" not in res.err.lower():
            raise classify(f"remove volumes {', '.join(names)}", res.err)


async def remove_networks(be: DockerSandboxBackend, names: list[str]) -> None:
    for name in names:
        res = await be.cli.run(["network", "rm", name], what=f"remove network {name}", check=False)
        if res.rc != 0 and "not found" not in res.err.lower() and "no such network" not in res.err.lower():
            raise classify(f"remove network {name}", res.err)


async def networks_labelled(be: DockerSandboxBackend, label: str, kind: str = "network") -> list[tuple[str, str]]:
    """(name, owner label) of the networks (or volumes: ``kind='volume'``) carrying ``label`` (``key=value``)."""
    from miles_sandbox_docker.lifecycle import OWNER_LABEL

    res = await be.cli.run([kind, "ls", "--filter", f"label={label}", "--format",
                            '{{.Name}}\t' + be.cli.label(OWNER_LABEL)], what=f"list {kind}s", check=False)
    if res.rc != 0:
        return []
    out = []
    for line in res.stdout.decode().splitlines():
        name, _, owner = line.strip().partition("\t")
        if name:
            out.append((name, owner))
    return out

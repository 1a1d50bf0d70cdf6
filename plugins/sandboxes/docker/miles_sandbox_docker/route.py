"""A route from inside a sandbox to one server on the host's loopback, and nowhere else.

``DockerSandbox.route_to_host(host, port)`` (the harness agent's route to its session server):

- host side, a :class:`~miles_engine.tito.forwarder.UnixForwarder`: a Unix socket in a fresh
  host directory, relaying each connection to ``host:port``;
- a forwarder container (``miles-<sandbox id>-route``, image ``route_image``, any image with
  ``python3``) that shares the sandbox container's network namespace
  (``--network container:…``) and has the socket's directory bind-mounted read-only; it runs
  the stdlib relay :data:`~miles_engine.tito.forwarder.RELAY`, listening on
  ``127.0.0.1:<ephemeral>`` of that namespace.

The sandbox reaches ``http://127.0.0.1:<port>`` and through it the one server; its network is
unchanged otherwise (mode ``none``: only loopback; services: its internal network), so the
host and the internet stay unreachable. The route goes with the sandbox (``close``), its
container carries the sandbox's labels (``sweep``, the orphan sweep). The socket needs the
engine on this host (a ``unix://`` engine); a remote engine is refused naming why.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import tempfile
import time
from typing import TYPE_CHECKING

from miles_engine.errors import SandboxError
from miles_engine.sandbox.protocol import SandboxSpec
from miles_engine.sandbox.remote import run_id_for
from miles_engine.tito.forwarder import RELAY, SOCKET_NAME, UnixForwarder

if TYPE_CHECKING:
    from miles_sandbox_docker.sandbox import DockerSandbox

MOUNT = "/miles-route"
READY_TIMEOUT_S = 30.0
_PORT = re.compile(rb"^port (\d+)$", re.MULTILINE)


class Route:
    """One open route: the host forwarder, its directory and the forwarder container."""

    def __init__(self, forwarder: UnixForwarder, host_dir: str, container: str) -> None:
        self.forwarder, self.host_dir, self.container = forwarder, host_dir, container
        self.port = 0

    async def close(self) -> None:
        await self.forwarder.close()
        shutil.rmtree(self.host_dir, ignore_errors=True)


async def open_route(sb: DockerSandbox, host: str, port: int) -> str:
    """Start a route from ``sb`` to ``host:port``; return its base URL as seen inside ``sb``."""
    be = sb.backend
    if not be.engine_is_local():
        raise SandboxError(f"sandbox {sb.id}: a route to the session server needs the docker engine on this host "
                           f"(its Unix socket is bind-mounted); DOCKER_HOST={be.cli.env().get('DOCKER_HOST')!r} "
                           "is remote")
    image = await be.image_for(SandboxSpec(image=be.options.route_image, paths=()), run_id_for(sb.spec, be.run_id))
    host_dir = tempfile.mkdtemp(prefix=f"miles-route-{sb.id}-")
    os.chmod(host_dir, 0o755)
    forwarder = UnixForwarder(os.path.join(host_dir, "sock", SOCKET_NAME), host, port)
    container = f"miles-{sb.id}-route-{len(sb.routes)}"
    route = Route(forwarder, host_dir, container)
    sb.routes.append(route)  # closed with the sandbox, also when anything below fails
    await forwarder.start()
    args = ["run", "--detach", "--rm", "--pull", "never", "--name", container,
            "--network", f"container:{sb.container}", "--volume", f"{host_dir}/sock:{MOUNT}:ro"]
    for key, value in sb.labels.items():
        args += ["--label", f"{key}={value}"]
    if be.options.pids_limit:
        args += ["--pids-limit", str(be.options.pids_limit)]
    args += ["--entrypoint", "python3", image, "-c", RELAY, f"{MOUNT}/{SOCKET_NAME}", "-"]
    sb.service_containers.append(container)
    await be.cli.run(args, what=f"start the session route of sandbox {sb.id}")
    route.port = await _wait_port(sb, container)
    return f"http://127.0.0.1:{route.port}"


async def _wait_port(sb: DockerSandbox, container: str) -> int:
    deadline = time.monotonic() + READY_TIMEOUT_S
    delay = 0.05
    while True:
        logs = await sb.cli.run(["logs", container], what=f"read the route of sandbox {sb.id}", check=False)
        found = _PORT.search(logs.stdout)
        if found:
            return int(found.group(1))
        text = (logs.stdout.decode(errors="replace") + logs.err).strip()[-300:]
        running = await sb.cli.run(["container", "inspect", "--format", "{{.State.Running}}", container],
                                   what="inspect the route", check=False)
        if running.rc != 0 or running.stdout.strip() != b"true" or time.monotonic() > deadline:
            raise SandboxError(f"sandbox {sb.id}: the session route's forwarder (image {sb.opts.route_image!r}, "
                               f"needs python3) did not start listening: {text or 'no output'}")
        await asyncio.sleep(delay)
        delay = min(0.5, delay * 1.5)


async def close_routes(sb: DockerSandbox) -> None:
    """Stop the host side of every route (their containers go with the sandbox's services)."""
    routes, sb.routes = sb.routes, []
    for route in routes:
        with contextlib.suppress(Exception):
            await route.close()

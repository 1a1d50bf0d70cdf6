"""The Docker sandbox backend: one container per sandbox, driven through the docker CLI."""

from __future__ import annotations

import asyncio
import logging
import resource
import secrets
import time
from typing import Any

from miles_engine.errors import SandboxError
from miles_engine.sandbox.protocol import RUN_LABEL, SANDBOX_LABEL, Capabilities, SandboxSpec, check_supported
from miles_engine.sandbox.remote import retry_idempotent, run_id_for, sandbox_labels

from miles_sandbox_docker import images, services
from miles_sandbox_docker.cli import DockerCli, EngineUnreachable, NoSuchContainer, classify
from miles_sandbox_docker.lifecycle import OWNER_LABEL, Limiter, StepMetrics, owner_id, owner_is_dead
from miles_sandbox_docker.options import DockerSandboxOptions
from miles_sandbox_docker.sandbox import DockerSandbox
from miles_sandbox_docker.scripts import KEEPALIVE, SETUP
from miles_sandbox_docker.standins import StandInResolver

log = logging.getLogger(__name__)
BACKEND_LABEL = "miles.backend"


def podman_inherited_ulimits() -> list[str]:
    """Podman drops containers.conf's default_ulimits once any --ulimit is given and asks for
    its own nofile / nproc, which runc (a child of the CLI: no daemon) may not raise past this
    process's hard limits ("error setting rlimit type 7"). Ask for no more than those (nproc at
    most 32768: higher values were refused on a Debian 12 host whose hard limit was above them;
    the pids limit is what bounds processes anyway)."""
    args = []
    for name, which, cap in (("nofile", resource.RLIMIT_NOFILE, 1 << 20), ("nproc", resource.RLIMIT_NPROC, 32768)):
        hard = resource.getrlimit(which)[1]
        value = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
        args += ["--ulimit", f"{name}={value}:{value}"]
    return args


class DockerSandboxBackend:
    """Containers on a Docker engine. Every container is labelled with the run id
    (``miles.run``) and its sandbox id, and ``sweep(run_id)`` removes a run's leftovers."""

    name = "docker"

    def __init__(self, options: DockerSandboxOptions | None = None) -> None:
        self.options = options or DockerSandboxOptions()
        o = self.options
        self.cli = DockerCli(o.binary, o.host, o.call_timeout_s)
        self.run_id = o.run_id
        self._live: set[DockerSandbox] = set()
        self._slots: set[DockerSandbox] = set()  # sandboxes holding a max_sandboxes slot
        self.limiter = Limiter(o.max_sandboxes, o.max_creates_per_s)
        self.metrics = StepMetrics()
        self._builds_in_flight: dict[str, asyncio.Lock] = {}  # one build per content at a time
        self._owner = owner_id()
        self.podman_firewall_checked = False  # podman_net.refuse_unless_ready passed once
        self._orphans_swept: asyncio.Task[list[str]] | None = None
        self.stand_ins = StandInResolver(self)

    def capabilities(self) -> Capabilities:
        o = self.options
        return Capabilities(
            isolation="container",
            network_modes=frozenset({"none", "public"}),
            images=True,
            dockerfile_build=True,
            absolute_paths=True,
            run_as_user=True,
            gpus=o.gpus,
            max_cpus=o.max_cpus,
            max_memory_mb=o.max_memory_mb,
            services=True,
            keep_entrypoint=True,
        )

    def describe(self) -> dict[str, Any]:
        detail = f"{self.cli.engine_name()} CLI {self.cli.executable_or_name()}"
        return {"detail": detail, "metrics": self.metrics.snapshot(), "images_stood_in": self.images_stood_in}

    @property
    def images_stood_in(self) -> dict[str, str]:
        """Image references this backend could not get and stood in for: ref -> stand-in image."""
        return dict(self.stand_ins.stood_in)

    def stats(self) -> dict[str, float]:
        """Per-step metrics: create / exec / destroy latency (p50, p95, n), builds and build cache hits."""
        return self.metrics.snapshot()

    def step_metrics(self) -> dict[str, float]:
        """The training log's ``sandbox/*`` for one step: latencies and image counts since the last call."""
        return self.metrics.window()

    async def ping(self) -> str:
        """The engine's version; raises the one-line unreachable error when there is none."""
        res = await self.cli.run(["version", "--format", "{{.Server.Version}}"], what="docker version", timeout_s=10)
        return res.stdout.decode().strip()

    # ---------------------------------------------------------------- create
    async def create(self, spec: SandboxSpec) -> DockerSandbox:
        check_supported(spec, self.capabilities(), backend=self.name)
        o = self.options
        run_id = run_id_for(spec, self.run_id)
        image = await self.image_for(spec, run_id)
        if o.sweep_orphans:
            await self.sweep_orphans_once()
        await self.limiter.acquire()
        sandbox_id = "sbx-" + secrets.token_hex(6)
        container = "miles-" + sandbox_id
        extra = {BACKEND_LABEL: self.name, OWNER_LABEL: self._owner}
        labels = sandbox_labels(spec, sandbox_id=sandbox_id, run_id=run_id, extra=extra)
        sb = DockerSandbox(self, spec, sandbox_id, container)
        sb.labels = labels
        self._live.add(sb)
        self._slots.add(sb)
        try:
            await self.limiter.pace()
            t0 = time.monotonic()
            if spec.services or spec.volumes:
                await services.create_volumes(self, sb, labels)
            if spec.services:
                sb.network = await services.create_network(self, sb, labels)
                await services.start_services(self, sb, sb.network, labels, run_id)
            sb.container_id = await self._run_container(container, image, spec, labels, network=sb.network)
            await self._setup(sb)
            if spec.files:
                await sb.put_files(spec.files)
            self.metrics.observe("create", time.monotonic() - t0)
        except BaseException:
            await asyncio.shield(sb.close())
            raise
        return sb

    async def image_for(self, spec: SandboxSpec, run_id: str) -> str:
        """The local image for a spec: built from ``spec.build`` (cached by content hash), else
        ``spec.image`` / ``default_image`` through the image map, pulled per the pull policy; a
        reference that cannot be had is stood in for (standins.py), in FROM lines too."""
        o = self.options
        if spec.build is not None:
            counters: dict[str, int] = {}
            tag = await images.ensure_build(
                self.cli, spec.build, run_id=run_id, timeout_s=o.build_timeout_s, retry=o.retry,
                image_map=o.image_map, network=o.build_network, stats=counters,
                resolve_from=self.stand_ins.from_ref, builds_in_flight=self._builds_in_flight,
            )
            for key, n in counters.items():
                self.metrics.count(key, n)
            return tag
        return await self.stand_ins.image(spec.image or o.default_image)

    def run_args(self, container: str, image: str, spec: SandboxSpec, labels: dict[str, str],
                 network: str | None = None) -> list[str]:
        """The ``docker run`` arguments for a spec (public for tests and debugging); ``network``:
        the sandbox's own network when it has services."""
        o, res = self.options, spec.resources
        # a kept ENTRYPOINT that exits must leave its exit code and output to report: no --rm
        # (close removes the container either way)
        args = ["run", "--detach", "--init", *([] if spec.keep_entrypoint else ["--rm"]), "--pull", "never",
                "--name", container]
        for key, value in labels.items():
            args += ["--label", f"{key}={value}"]
        args += ["--network", network or ("none" if spec.network.mode == "none" else o.public_network)]
        args += ["--hostname", container[:63]]
        cpus = res.cpus or o.default_cpus
        if cpus:
            args += ["--cpus", f"{cpus:g}"]
        if res.memory_mb:
            args += ["--memory", f"{res.memory_mb}m", "--memory-swap", f"{res.memory_mb}m"]
        if res.disk_mb and o.enforce_disk:
            args += ["--storage-opt", f"size={res.disk_mb}M"]
        if res.gpus:
            args += ["--gpus", str(res.gpus)]
        if o.pids_limit:
            args += ["--pids-limit", str(o.pids_limit)]
        if o.max_file_size_mb:
            args += ["--ulimit", f"fsize={o.max_file_size_mb << 20}"]
            if self.cli.engine_name() == "podman":
                args += podman_inherited_ulimits()
        for key, value in spec.env.items():
            args += ["--env", f"{key}={value}"]
        for path, host in o.ro_binds.items():
            args += ["--volume", f"{host}:{path}:ro"]
        if spec.user:
            args += ["--user", spec.user]
        if spec.volumes:
            args += services.volume_args(labels[SANDBOX_LABEL], spec.volumes)
        # podman refuses a --workdir the image lacks (docker creates it); setup creates it, and
        # commands start there either way
        workdir = spec.workdir or "/" if self.cli.engine_name() == "docker" else "/"
        keepalive = ["-c", KEEPALIVE, "miles-keepalive", f"{spec.ttl_s:g}" if spec.ttl_s else ""]
        if spec.keep_entrypoint:
            # as Harbor's compose starts it: the image's ENTRYPOINT and WORKDIR, the keep-alive as
            # the command (an entrypoint script ending in `exec "$@"` hands over to it); commands
            # still start in spec.workdir
            return [*args, image, "/bin/sh", *keepalive]
        return [*args, "--workdir", workdir, "--entrypoint", "/bin/sh", image, *keepalive]

    async def _run_container(self, container: str, image: str, spec: SandboxSpec, labels: dict[str, str],
                             network: str | None = None) -> str:
        """Start the container; return its id ('' when the engine's answer did not carry it)."""
        what = f"start container for image '{image}'"
        args = self.run_args(container, image, spec, labels, network=network)
        tries = 0

        async def attempt() -> str:
            nonlocal tries
            tries += 1
            res = await self.cli.run(args, what=what, check=False)
            if res.rc == 0:
                return res.stdout.decode(errors="replace").strip().splitlines()[-1:][0] if res.stdout.strip() else ""
            if tries > 1 and "conflict" in res.err.lower() and await self._is_ours(container, labels[SANDBOX_LABEL]):
                return ""  # our earlier attempt did start it; only its answer was lost
            raise classify(what, res.err)

        return await retry_idempotent(attempt, what=what, policy=self.options.retry)

    def engine_is_local(self) -> bool:
        """The engine runs on this host (a unix socket), so its processes are visible in /proc."""
        host = self.cli.env().get("DOCKER_HOST", "")
        return not host or host.startswith("unix://")

    async def _is_ours(self, container: str, sandbox_id: str) -> bool:
        res = await self.cli.run(
            ["container", "inspect", "--format", '{{index .Config.Labels "' + SANDBOX_LABEL + '"}}', container],
            what=f"inspect container {container}",
            check=False,
        )
        return res.rc == 0 and res.stdout.decode().strip() == sandbox_id

    async def _setup(self, sb: DockerSandbox) -> None:
        """Create the spec's paths (as root; handed to the spec's user) and prove /bin/sh works."""
        spec = sb.spec
        dirs = sorted({*spec.paths, spec.workdir or "/"} - {"/"})
        what = f"prepare sandbox {sb.id}"
        script = SETUP + ('chown -- "$MILES_OWNER" "$@"\n' if spec.user else "")
        args = ["exec", "-u", "0"] + (["-e", f"MILES_OWNER={spec.user}"] if spec.user else [])
        args += [sb.container, "/bin/sh", "-c", script, "miles-setup", *dirs]
        res = await self.cli.run(args, what=what, check=False)
        if res.rc != 0:
            if spec.keep_entrypoint:
                exited = await self.entrypoint_exit(sb)
                if exited:
                    raise SandboxError(f"{what}: {exited}")
            raise sb._exec_failure(res.err, what=what)

    async def entrypoint_exit(self, sb: DockerSandbox) -> str | None:
        """Why a container started with its image's ENTRYPOINT is not running (its exit code and
        last output), or None when it runs or cannot be inspected."""
        state = await self.cli.run(["container", "inspect", "--format", "{{.State.Running}} {{.State.ExitCode}}",
                                    sb.container], what=f"inspect sandbox {sb.id}", check=False)
        running, _, code = state.stdout.decode(errors="replace").strip().partition(" ")
        if state.rc != 0 or running == "true":
            return None
        logs = await self.cli.run(["logs", "--tail", "20", sb.container], what=f"logs of sandbox {sb.id}", check=False)
        output = (logs.stdout.decode(errors="replace") + logs.err).strip()[-1500:]
        return (f"the image's ENTRYPOINT exited with code {code} (the sandbox keeps the image's ENTRYPOINT, "
                f"which must keep running or end in `exec \"$@\"` to hand over to the keep-alive command); "
                + (f"its last output:\n{output}" if output else "it printed nothing"))

    # ---------------------------------------------------------------- removal
    async def _remove(self, container: str, sandbox_id: str) -> None:
        what = f"remove sandbox {sandbox_id}"

        async def attempt() -> None:
            try:
                await self.cli.run(["rm", "--force", "--volumes", container], what=what)
            except NoSuchContainer:
                return
            except SandboxError as exc:
                if "no such container" in str(exc).lower():
                    return
                raise

        await retry_idempotent(attempt, what=what, policy=self.options.retry)

    def _forget(self, sb: DockerSandbox) -> None:
        self._live.discard(sb)
        if sb in self._slots:
            self._slots.discard(sb)
            self.limiter.release()

    async def sweep_orphans_once(self) -> list[str]:
        """Once per backend: remove containers whose creating miles process (on this host) is
        dead, e.g. a SIGKILLed training run's. Returns their sandbox ids."""
        if self._orphans_swept is None:
            self._orphans_swept = asyncio.ensure_future(self._sweep_orphans())
        try:
            return await asyncio.shield(self._orphans_swept)
        except EngineUnreachable:
            self._orphans_swept = None  # nothing to sweep yet; try again with the next create
            raise
        except SandboxError as exc:
            log.warning("docker sandbox: orphan sweep failed: %s", exc)
            return []

    async def _sweep_orphans(self) -> list[str]:
        fmt = "{{.ID}}\t" + self.cli.label(SANDBOX_LABEL) + "\t" + self.cli.label(OWNER_LABEL)
        listed = await self.cli.run(
            ["ps", "--all", "--no-trunc", "--filter", f"label={BACKEND_LABEL}={self.name}", "--format", fmt],
            what="list docker sandboxes", check=False,
        )
        if listed.rc != 0:
            raise classify("list docker sandboxes", listed.err)
        removed = []
        for line in listed.stdout.decode().splitlines():
            cid, sid, owner = (line.strip().split("\t") + ["", ""])[:3]
            if cid and owner and owner_is_dead(owner):
                await self._remove(cid, sid or cid)
                removed.append(sid or cid)
        dead_nets = [n for n, owner in await services.networks_labelled(self, f"{BACKEND_LABEL}={self.name}")
                     if owner and owner_is_dead(owner)]
        await services.remove_networks(self, dead_nets)
        await services.remove_volumes(self, [v for v, owner in await services.networks_labelled(
            self, f"{BACKEND_LABEL}={self.name}", kind="volume") if owner and owner_is_dead(owner)])
        if removed:
            log.warning("docker sandbox: removed %d container(s) left by dead miles processes: %s",
                        len(removed), ", ".join(removed))
        return removed

    async def sweep(self, run_id: str) -> list[str]:
        """Remove every container labelled ``miles.run=run_id``; return their sandbox ids."""
        if not run_id:
            raise SandboxError("sweep needs a run id")
        fmt = "{{.ID}}\t" + self.cli.label(SANDBOX_LABEL)
        listed = await retry_idempotent(
            lambda: self.cli.run(
                ["ps", "--all", "--no-trunc", "--filter", f"label={RUN_LABEL}={run_id}", "--format", fmt],
                what=f"list sandboxes of run '{run_id}'",
            ),
            what=f"list sandboxes of run '{run_id}'",
            policy=self.options.retry,
        )
        found: list[tuple[str, str]] = []
        for line in listed.stdout.decode().splitlines():
            cid, _, sid = line.strip().partition("\t")
            if cid:
                found.append((cid, sid or cid))
        removed: list[str] = []
        for cid, sid in found:
            await self._remove(cid, sid)
            removed.append(sid)
        await services.remove_networks(self, [n for n, _ in await services.networks_labelled(self, f"{RUN_LABEL}={run_id}")])
        await services.remove_volumes(self, [v for v, _ in await services.networks_labelled(
            self, f"{RUN_LABEL}={run_id}", kind="volume")])
        if removed:
            log.info("swept %d docker sandbox(es) of run %s", len(removed), run_id)
        return removed

    async def aclose(self) -> None:
        """Close every sandbox this backend still has open."""
        if self._live:
            await asyncio.gather(*(sb.close() for sb in list(self._live)), return_exceptions=True)


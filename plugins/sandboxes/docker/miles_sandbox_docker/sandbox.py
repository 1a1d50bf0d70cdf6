"""One live Docker sandbox: a container kept idle by its main process, commands by
``docker exec``, files through ``docker cp`` tar streams."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from miles_engine.errors import SandboxError
from miles_engine.sandbox.protocol import ExecResult, IsolationLevel, SandboxSpec
from miles_engine.sandbox.remote import read_capped, retry_idempotent

from miles_sandbox_docker import tarstream
from miles_sandbox_docker.cgroup import HostProcess, container_pids, sigkill_tagged
from miles_sandbox_docker.cli import NoSuchContainer, classify
from miles_sandbox_docker.scripts import EXEC_ENV, EXEC_WRAPPER, KILL_TREE, START_MARK

if TYPE_CHECKING:
    from miles_sandbox_docker.backend import DockerSandboxBackend


class DockerSandbox:
    """Use as ``async with await backend.create(spec) as sb: await sb.exec("ls")``."""

    isolation: IsolationLevel = "container"

    def __init__(self, backend: DockerSandboxBackend, spec: SandboxSpec, sandbox_id: str, container: str) -> None:
        self.backend = backend
        self.spec = spec
        self.id = sandbox_id
        self.container = container  # the container's name (miles-<id>): stable across retries
        self.cli = backend.cli
        self.opts = backend.options
        self._closed = False
        self.dead_reason: str | None = None  # set when the backend had to kill the container
        self.container_id = ""  # the engine's full id (as in the host's cgroup paths)
        self.network: str | None = None  # its own network, when it has services
        self.service_containers: list[str] = []
        self.labels: dict[str, str] = {}  # the run, sandbox and owner labels its containers carry
        self.routes: list = []  # miles_sandbox_docker.route.Route: routes to host servers
        self.volumes: list[str] = []  # engine volumes of its compose volume names
        self._follow = [] if self.cli.engine_name() == "podman" else ["-L"]  # podman cp follows links itself
        self._close_task: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")

    async def alive(self) -> bool:
        if self._closed:
            return False
        res = await self.cli.run(
            ["container", "inspect", "--format", "{{.State.Running}}", self.container],
            what=f"inspect sandbox {self.id}",
            check=False,
        )
        if res.rc != 0:
            err = classify(f"inspect sandbox {self.id}", res.err)
            if isinstance(err, NoSuchContainer) or "no such object" in res.err.lower():
                return False
            raise err
        return res.stdout.strip() == b"true"

    async def close(self) -> None:
        """Remove the container (and everything running in it). Idempotent."""
        if self._close_task is None:
            self._closed = True
            self._close_task = asyncio.ensure_future(self._timed_remove())
        try:
            await asyncio.shield(self._close_task)
        finally:
            self.backend._forget(self)

    def leftover_processes(self) -> list[HostProcess] | None:
        """Host processes still in this container's cgroup (None: not observable from here,
        the engine is remote or the id is unknown)."""
        if not self.container_id or not self.backend.engine_is_local():
            return None
        return [HostProcess(pid) for pid in container_pids(self.container_id)]

    async def route_to_host(self, host: str, port: int) -> str:
        """A route from inside this sandbox to ``host:port`` (a server on the host's loopback) and
        nowhere else; returns its base URL as the sandbox sees it (see :mod:`.route`)."""
        from miles_sandbox_docker.route import open_route

        self._check_open()
        return await open_route(self, host, port)

    async def _timed_remove(self) -> None:
        t0 = time.monotonic()
        try:
            await self.backend._remove(self.container, self.id)
        finally:
            if self.network or self.service_containers or self.volumes:
                from miles_sandbox_docker.services import remove_services

                await remove_services(self.backend, self)
            if self.routes:
                from miles_sandbox_docker.route import close_routes

                await close_routes(self)
        self.backend.metrics.observe("destroy", time.monotonic() - t0)

    async def __aenter__(self) -> DockerSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---------------------------------------------------------------- commands
    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
        max_output_bytes: int | None = None,
        user: str | None = None,
    ) -> ExecResult:
        """Run ``cmd`` once (never retried: it may have side effects)."""
        self._check_open()
        if isinstance(cmd, str):
            tail = ["--shell", cmd]
        else:
            argv = [str(a) for a in cmd]
            if not argv:
                raise SandboxError("exec needs a command: got an empty argument list")
            tail = ["--argv", *argv]
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if max_output_bytes is not None and max_output_bytes < 0:
            raise ValueError(f"max_output_bytes must be >= 0, got {max_output_bytes}")
        timeout = self.opts.default_timeout_s if timeout_s is None else timeout_s
        cap = self.opts.max_output_bytes if max_output_bytes is None else max_output_bytes
        token = secrets.token_hex(8)
        args = ["exec"] + (["-i"] if stdin is not None else []) + ["-e", f"{EXEC_ENV}={token}"]
        for key, value in (env or {}).items():
            args += ["-e", f"{key}={value}"]
        if user is not None:
            args += ["-u", user]
        args += [self.container, "/bin/sh", "-c", EXEC_WRAPPER, "miles-exec", cwd or self.spec.workdir or ".", *tail]

        t0 = time.monotonic()
        proc = await self.cli.spawn(args, stdin=stdin is not None)
        assert proc.stdout is not None and proc.stderr is not None
        out_task = asyncio.ensure_future(read_capped(proc.stdout, cap + len(START_MARK)))
        err_task = asyncio.ensure_future(read_capped(proc.stderr, cap))
        feed_task = asyncio.ensure_future(_feed(proc, stdin))
        timed_out = False
        try:
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.gather(out_task, err_task, proc.wait())), timeout)
            except asyncio.TimeoutError:
                timed_out = True
                handled = await self._kill_tree_from_host(token)  # None: not possible from here
                if handled is None and not await self._kill_tree(token):
                    await self._kill_container()
                try:  # the CLI exits once the killed command's streams close
                    await asyncio.wait_for(asyncio.shield(asyncio.gather(out_task, err_task, proc.wait())), 5)
                except asyncio.TimeoutError:
                    proc.kill()
                    await asyncio.gather(out_task, err_task, proc.wait())
        except BaseException:  # cancelled: leave nothing running in the container or here
            if not timed_out:
                await asyncio.shield(self._kill_tree(token))
            if proc.returncode is None:
                proc.kill()
            raise
        finally:
            feed_task.cancel()
        duration = time.monotonic() - t0
        self.backend.metrics.observe("exec", duration)
        (out, out_cut), (err, err_cut) = out_task.result(), err_task.result()
        if out.startswith(START_MARK):
            out = out[len(START_MARK) :]
        elif not timed_out:  # docker never started the command: the sandbox is the problem
            if self.spec.keep_entrypoint and self.dead_reason is None:  # the image's ENTRYPOINT may have exited
                self.dead_reason = await self.backend.entrypoint_exit(self)
            raise self._exec_failure(err.decode(errors="replace"))
        return ExecResult(
            exit_code=None if timed_out else proc.returncode,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            timed_out=timed_out,
            truncated=out_cut or err_cut,
            duration_s=round(duration, 6),
            isolation=self.isolation,
        )

    def _exec_failure(self, stderr: str, what: str | None = None) -> SandboxError:
        """The error for an exec that docker could not start (or, with ``what``, that failed)."""
        err = classify(what or f"exec in sandbox {self.id}", stderr)
        if isinstance(err, NoSuchContainer):
            why = self.dead_reason or "its container is gone or stopped"
            return SandboxError(f"sandbox {self.id} is dead: {why} ({stderr.strip()})")
        if '"/bin/sh"' in stderr:
            return SandboxError(
                f"sandbox {self.id}: the image has no /bin/sh ({stderr.strip()}); "
                f"the docker backend needs a POSIX shell in the image"
            )
        return err

    async def _kill_tree(self, token: str) -> bool:
        """SIGKILL every process of one exec (bounded: close() removes all). False when the
        kill script could not run, e.g. a fork bomb holds every slot of the pids limit."""
        try:
            res = await self.cli.run(
                ["exec", "-u", "0", self.container, "/bin/sh", "-c", KILL_TREE, "miles-kill", token],
                what=f"kill timed-out command in sandbox {self.id}",
                timeout_s=self.opts.kill_timeout_s,
                check=False,
            )
        except SandboxError:
            return False
        return res.rc == 0

    async def _kill_tree_from_host(self, token: str) -> bool | None:
        """With the engine on this host: SIGKILL the exec's processes (those of this
        container's cgroup carrying the token) from outside, which needs no free process slot
        inside. A tree that keeps forking (a fork bomb) is frozen first: pause the container
        (the cgroup freezer), kill, unpause (they die on thaw). Whether any was found; None
        when this cannot be done from here (remote engine, unknown id, cgroup not visible)."""
        if not self.container_id or not self.backend.engine_is_local():
            return None
        marker = f"{EXEC_ENV}={token}".encode()
        try:
            if not await asyncio.to_thread(container_pids, self.container_id, strict=True):
                return None  # not even the container's init is visible: its cgroup is not ours to read
        except OSError:
            return None
        found = False
        for _ in range(3):
            if not await asyncio.to_thread(sigkill_tagged, self.container_id, marker):
                return found
            found = True
        what = f"freeze sandbox {self.id}"
        try:
            paused = (await self.cli.run(["pause", self.container], what=what, check=False)).rc == 0
        except SandboxError:
            paused = False  # it may still have paused: unpause below regardless
        try:
            await asyncio.to_thread(sigkill_tagged, self.container_id, marker)
        finally:
            await self._unpause(certain=paused)
        return True

    async def _unpause(self, *, certain: bool) -> None:
        """Thaw the container (retried: a container left paused would hang every later exec)."""
        for _ in range(3):
            try:
                res = await self.cli.run(["unpause", self.container], what=f"thaw sandbox {self.id}", check=False)
            except SandboxError:
                continue
            if res.rc == 0 or not certain or "not paused" in res.err.lower():
                return

    async def _kill_container(self) -> None:
        """The last resort for a command that cannot be killed from inside (a fork bomb at
        the pids limit): kill the whole container. The sandbox is dead afterwards."""
        self.dead_reason = "its container was killed: a timed-out command could not be stopped inside it"
        try:
            await self.cli.run(["kill", self.container], what=f"kill sandbox {self.id}", check=False,
                               timeout_s=self.opts.kill_timeout_s)
        except SandboxError:
            pass

    # ---------------------------------------------------------------- files
    async def _cp_in(self, tar: bytes, dest: str, what: str) -> None:
        self._check_open()
        try:
            await retry_idempotent(
                lambda: self.cli.run(["cp", "-", f"{self.container}:{dest}"], what=what, stdin=tar),
                what=what,
                policy=self.opts.retry,
            )
        except SandboxError as exc:
            # The CLI reports a vanished container as 'destination ... must be a directory'.
            if "must be a directory" in str(exc) and not await self.alive():
                raise SandboxError(f"{what}: sandbox {self.id} is dead: its container is gone or stopped") from exc
            raise
        if self.spec.user:  # docker cp writes as root; hand the files to the sandbox user
            names = tarstream.top_paths(tar, dest)
            await retry_idempotent(
                lambda: self.cli.run(
                    ["exec", "-u", "0", self.container, "chown", "-R", "--", self.spec.user or "", *names], what=what
                ),
                what=what,
                policy=self.opts.retry,
            )

    async def _cp_out(self, path: str, limit: int, what: str) -> tuple[bytes, bool]:
        """The tar stream of ``path`` (following a symlink) cut at ``limit`` bytes, and
        whether it was cut; FileNotFoundError when ``path`` does not exist."""
        self._check_open()

        async def call() -> tuple[bytes, bool]:
            res = await self.cli.run(
                ["cp", *self._follow, f"{self.container}:{path}", "-"], what=what, max_stdout=limit, check=False
            )
            if res.rc != 0:
                if "could not find the file" in res.err.lower() or "no such file" in res.err.lower():
                    raise FileNotFoundError(f"no such file in sandbox {self.id}: {path}")
                raise classify(what, res.err)
            return res.stdout, res.truncated

        return await retry_idempotent(call, what=what, policy=self.opts.retry)

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        payload = data.encode() if isinstance(data, str) else bytes(data)
        target = tarstream.absolute(path, self.spec.workdir)
        await self._cp_in(tarstream.pack_files({target: (payload, mode)}), "/", f"write_file '{path}' in sandbox {self.id}")

    async def put_files(self, files: Mapping[str, bytes]) -> None:
        """Write several files in one transfer (the spec's seed files)."""
        packed = {tarstream.absolute(p, self.spec.workdir): (bytes(d), 0o644) for p, d in files.items()}
        await self._cp_in(tarstream.pack_files(packed), "/", f"seed files of sandbox {self.id}")

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        cap = self.opts.max_transfer_mb << 20
        want = cap if max_bytes is None else max(0, max_bytes)
        target = tarstream.absolute(path, self.spec.workdir)
        stream, _ = await self._cp_out(target, want + tarstream.SLACK, f"read_file '{path}' in sandbox {self.id}")
        data, cut = tarstream.single_file(stream, want, path=path, sandbox_id=self.id)
        if cut and max_bytes is None:
            raise SandboxError(
                f"read_file '{path}': larger than max_transfer_mb={self.opts.max_transfer_mb}; pass max_bytes"
            )
        return data

    async def upload_dir(self, local: Path, remote: str) -> None:
        local = Path(local)
        if not local.is_dir():
            raise NotADirectoryError(f"upload_dir: local path is not a directory: {local}")
        target = tarstream.absolute(remote, self.spec.workdir)
        if not any(local.iterdir()):
            return  # nothing to copy (podman's cp refuses an empty tar stream)
        tar = await asyncio.to_thread(tarstream.pack_dir, local, target)
        await self._cp_in(tar, "/", f"upload_dir '{local}' -> '{remote}' in sandbox {self.id}")

    async def download_dir(self, remote: str, local: Path) -> None:
        target = tarstream.absolute(remote, self.spec.workdir)
        limit = (self.opts.max_transfer_mb << 20) + tarstream.SLACK
        stream, cut = await self._cp_out(target, limit, f"download_dir '{remote}' from sandbox {self.id}")
        if cut:
            raise SandboxError(f"download_dir '{remote}': more than max_transfer_mb={self.opts.max_transfer_mb}")
        await asyncio.to_thread(tarstream.unpack_dir, stream, Path(local), remote=remote, sandbox_id=self.id)

    def __repr__(self) -> str:
        return f"<DockerSandbox {self.id} {'closed' if self._closed else 'open'}>"


async def _feed(proc: asyncio.subprocess.Process, data: bytes | None) -> None:
    if proc.stdin is None:
        return
    try:
        if data:
            proc.stdin.write(data)
            await proc.stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the command did not read all of its input
    finally:
        proc.stdin.close()

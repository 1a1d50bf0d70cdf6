"""One live local sandbox: a scratch dir, maybe a namespace, and the commands run in it."""

from __future__ import annotations

import asyncio
import os
import posixpath
import secrets
import subprocess
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from miles_engine.errors import SandboxError, SandboxUnsupportedError
from miles_engine.sandbox.local import (
    fileops,
    initexec,
    namespace,
    process,
    procscan,
    scratch,
    teardown,
    uidpool,
    warm,
)
from miles_engine.sandbox.local.env import build_env
from miles_engine.sandbox.protocol import ExecResult, IsolationLevel, SandboxSpec

if TYPE_CHECKING:
    from miles_engine.sandbox.local.backend import LocalSandboxBackend

INIT_TIMEOUT_S = 15.0
RESET_TIMEOUT_S = 2.0
_MIB = 1 << 20


class LocalSandbox:
    """Use as ``async with await backend.create(spec) as sb: await sb.exec("ls")``.

    Paths given to ``exec(cwd=...)`` and the file operations are sandbox paths: in the
    namespace tier they are what the command sees (``/app/x``); in the process tier the
    spec's ``workdir`` (and relative paths) map onto the scratch work dir.
    """

    def __init__(self, backend: LocalSandboxBackend, spec: SandboxSpec) -> None:
        self.backend = backend
        self.spec = spec
        self.opts = backend.options
        self.id = "sbx-" + secrets.token_hex(6)
        self.isolation: IsolationLevel = backend.capabilities().isolation
        self.workdir = posixpath.normpath(spec.workdir or "/")
        self.scratch = ""
        self.lease: uidpool.UidLease | None = None
        self.ids: tuple[int, int] | None = None
        self.mapped: dict[str, str] = {}
        self.host_workdir = ""
        self._init: subprocess.Popen[bytes] | None = None
        self._pid1: int | None = None
        self._pidns: str | None = None
        self._closed = False
        self._close_task: asyncio.Task[None] | None = None
        self._ttl: asyncio.TimerHandle | None = None
        self._scratch_lock: int | None = None
        self.closed_leftovers: list[procscan.ProcInfo] = []
        self._parked_pids: frozenset[int] = frozenset()
        self._channel: initexec.InitChannel | None = None  # PID 1 runs the commands (bwrap tier)

    # ---------------------------------------------------------------- lifecycle
    @property
    def namespaced(self) -> bool:
        return self.isolation == "namespace"

    @property
    def uid(self) -> int | None:
        return self.ids[0] if self.ids else None

    async def start(self) -> None:
        try:
            if os.geteuid() == 0:
                self.lease = await asyncio.to_thread(uidpool.lease_uid, self.opts.uid_base, self.opts.uid_pool_size)
                self.ids = (self.lease.uid, self.lease.uid)
            mapped_paths = self._mapped_paths()
            self.scratch = await asyncio.to_thread(
                scratch.make_scratch, self.opts.scratch_root, self.id, mapped=mapped_paths, ids=self.ids
            )
            self._scratch_lock = scratch.hold(self.scratch)
            self.mapped = {p: scratch.fs_dir(self.scratch, p) for p in mapped_paths}
            self.host_workdir = os.path.join(self.scratch, "fs", "work")
            if self.namespaced:
                await self._start_namespace()
            await self._seed()
            self._arm_ttl()
        except BaseException:
            await self.close()
            raise

    def _mapped_paths(self) -> list[str]:
        return warm.mapped_paths(self.spec) if self.namespaced else ["/work"]

    def _host_path(self, path: str) -> str | None:
        """Host path inside the scratch dir for a sandbox path, or ``None`` if unmapped."""
        if not self.namespaced:
            host = self.resolve(path)
            return host if host == self.host_workdir or host.startswith(self.host_workdir + "/") else None
        p = self.resolve(path)
        for root, host in self.mapped.items():
            if p == root or p.startswith(root + "/"):
                return os.path.normpath(host + p[len(root) :])
        return None

    async def _seed(self) -> None:
        """Initial files and the workdir: written on the host into the fresh scratch dir;
        paths outside it go through the sandbox (and fail if it cannot write there)."""
        direct: dict[str, bytes] = {}
        indirect: dict[str, bytes] = {}
        for path, data in self.spec.files.items():
            host = self._host_path(path)
            payload = data.encode() if isinstance(data, str) else bytes(data)
            (direct if host else indirect)[host or path] = payload
        wd = self._host_path(self.workdir)
        if direct or (wd and not os.path.isdir(wd)):
            await asyncio.to_thread(scratch.seed, direct, [wd] if wd else [], self.ids)
        if indirect:
            await fileops.put_files(self, indirect)

    async def _start_namespace(self) -> None:
        tools = self.backend.probe.tools
        assert tools is not None
        via_init = tools.launcher == "bwrap" and self.opts.exec_via_init
        self._init, self._pid1 = await namespace.launch(
            tools,
            self.mapped,
            scratch_dir=self.scratch,
            ids=self.ids,
            public_network=self.spec.network.mode == "public",
            hidden=self.opts.hidden_paths,
            ro_binds=self.opts.ro_binds,
            hostname="miles-" + self.id[4:],
            timeout_s=INIT_TIMEOUT_S,
            # PID 1 forks the commands: its hard limits bound whatever it is asked to run
            limits=self._limits(cpu=False) if via_init else None,
        )
        self._pidns = procscan.pid_namespace(self._pid1)
        if via_init:
            self._channel = initexec.InitChannel(self._init, self._pid1, os.path.join(self.scratch, "ctl"), self.ids)

    def _limits(self, *, cpu: bool = True) -> process.Limits:
        o = self.opts
        return process.Limits(
            cpu_s=o.cpu_time_s if cpu else None,
            address_space_bytes=(self.spec.resources.memory_mb or o.memory_mb or 0) * _MIB or None,
            open_files=o.max_open_files,
            file_size_bytes=(o.max_file_size_mb or 0) * _MIB or None,
            # Counted per uid *and user namespace*: a dedicated uid or the sandbox's own userns
            # makes it a per-sandbox limit; a shared uid in the host namespace would not.
            processes=o.max_processes if (self.ids or self.namespaced) else None,
        )

    async def alive(self) -> bool:
        if self._closed:
            return False
        if not self.namespaced:
            return True
        return self._init is not None and self._init.poll() is None and procscan.pid_alive(self._pid1)

    async def close(self) -> None:
        """Kill every process of the sandbox, then remove its scratch dir. Idempotent."""
        if self._close_task is None:
            self._closed = True
            self._close_task = asyncio.ensure_future(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        if self._ttl is not None:
            self._ttl.cancel()
        if self.backend.wants_warm(self) and await self._reset_for_reuse():
            self.backend.park(self._hand_over())
            self.backend._forget(self)
            return
        await teardown.destroy(self)

    # ---------------------------------------------------------------- warm reuse
    @property
    def warm_key(self) -> tuple[object, ...] | None:
        """Pool key, or ``None`` when this sandbox cannot be reset in place (process tier;
        the unshare launcher, whose /dev and /home are tmpfs only code inside can empty)."""
        tools = self.backend.probe.tools
        if not self.namespaced or tools is None or tools.launcher != "bwrap" or self.opts.keep_scratch \
                or self._channel is None:
            return None
        return warm.warm_key(self.spec)

    async def _reset_for_reuse(self) -> bool:
        """Back to the state of a fresh sandbox (:func:`warm.reset_in_place`); False (the
        sandbox is then destroyed) on any doubt."""
        if self._init is None or self._pid1 is None or self._channel is None:
            return False
        dirs = [*self.mapped.values(), os.path.join(self.scratch, "shm")]
        return await warm.reset_in_place(self._init, self._pid1, self._channel, dirs, self.ids, RESET_TIMEOUT_S)

    def _hand_over(self) -> LocalSandbox:
        """Move the live namespace, scratch dir and uid lease to a new, unused handle: this
        one stays closed, so a caller keeping it can never reach the next episode."""
        fresh = LocalSandbox(self.backend, self.spec)  # a new id: each use has its own process marker
        for name in ("scratch", "lease", "ids", "mapped", "host_workdir", "_init", "_pid1", "_pidns", "_scratch_lock",
                     "_channel"):
            setattr(fresh, name, getattr(self, name))
        # Its uid now belongs to the next use: leftovers of this use are found by this use's
        # marker only; the reset has just confirmed that no process but PID 1 was left.
        self._parked_pids = frozenset(p for p in (self._init.pid if self._init else None, self._pid1) if p)
        self.ids = None
        self.scratch, self.host_workdir, self.mapped = "", "", {}
        self.lease, self._init, self._pid1, self._pidns, self._scratch_lock = None, None, None, None, None
        self._channel = None
        return fresh

    async def reuse(self, spec: SandboxSpec) -> None:
        """Serve ``spec`` from this warm sandbox (same :func:`warm_key`): new files, workdir, TTL."""
        self.spec = spec
        self.workdir = posixpath.normpath(spec.workdir or "/")
        try:
            await self._seed()
            self._arm_ttl()
        except BaseException:
            await self.close()
            raise

    def _arm_ttl(self) -> None:
        if self.spec.ttl_s:
            loop = asyncio.get_running_loop()
            self._ttl = loop.call_later(self.spec.ttl_s, lambda: asyncio.ensure_future(self.close()))

    async def __aenter__(self) -> LocalSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def leftover_processes(self) -> list[procscan.ProcInfo]:
        """Processes of this sandbox alive now, seen from the host's /proc (by its dedicated
        uid, else by its PID namespace or marker variable). Includes the namespace's own init while open;
        must be empty after ``close``."""
        # A dead namespace's inode number can be reused by a new sandbox: match it only
        # while this sandbox's PID 1 holds it.
        live_ns = self._pidns if not self._closed and procscan.pid_alive(self._pid1) else None
        found = procscan.find_processes(uid=self.uid, sandbox_id=self.id, pidns=live_ns)
        # Closed into the warm pool: its launcher and init now belong to the parked sandbox.
        return [p for p in found if p.pid not in self._parked_pids]

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
        if isinstance(cmd, str):
            argv = ["bash", "-c", cmd]
        else:
            argv = [str(a) for a in cmd]
            if not argv:
                raise SandboxError("exec needs a command: got an empty argument list")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if max_output_bytes is not None and max_output_bytes < 0:
            raise ValueError(f"max_output_bytes must be >= 0, got {max_output_bytes}")
        if user not in (None, "root", "0") or (user is not None and not self.namespaced):
            raise SandboxUnsupportedError(f"the local sandbox cannot run commands as user '{user}'")
        raw = await self.run_raw(
            argv,
            cwd=cwd,
            env=env,
            stdin=stdin,
            timeout_s=self.opts.default_timeout_s if timeout_s is None else timeout_s,
            max_output=self.opts.max_output_bytes if max_output_bytes is None else max_output_bytes,
        )
        return ExecResult(
            exit_code=raw.exit_code,
            stdout=raw.stdout.decode(errors="replace"),
            stderr=raw.stderr.decode(errors="replace"),
            timed_out=raw.timed_out,
            truncated=raw.truncated,
            duration_s=round(raw.duration_s, 6),
            isolation=self.isolation,
        )

    async def run_raw(
        self,
        argv: Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | int | None = None,
        timeout_s: float,
        max_output: int,
        stdout_sink=None,
    ) -> process.RawResult:
        """Run ``argv`` in the sandbox and return raw bytes (the file operations use this)."""
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        if self.namespaced and not await self.alive():
            raise SandboxError(f"sandbox {self.id} is dead: its namespace init process exited")
        o = self.opts
        limits = self._limits()
        work = self.resolve(cwd) if cwd else (self.workdir if self.namespaced else self.host_workdir)
        full_env = build_env(
            sandbox_id=self.id,
            home="/root" if self.namespaced else os.path.join(self.scratch, "home"),
            user="root" if self.namespaced else "sandbox",
            tmpdir=None if self.namespaced else os.path.join(self.scratch, "tmp"),
            passthrough=o.env_passthrough,
            spec_env=self.spec.env,
            exec_env=env,
        )
        if self._channel is not None and not isinstance(stdin, int):
            return await self._channel.run(argv, env=full_env, cwd=work, limits=limits, stdin=stdin,
                                           timeout_s=timeout_s, max_output=max_output,
                                           kill_grace_s=o.kill_grace_s, stdout_sink=stdout_sink)
        if self.namespaced:
            assert self.backend.probe.tools is not None and self._pid1 is not None
            argv = namespace.exec_prefix(
                self.backend.probe.tools, self._pid1, net=self.spec.network.mode != "public", cwd=work
            ) + list(argv)
            work_host = None
        else:
            work_host = work
        raw = await process.run(
            argv,
            env=full_env,
            cwd=work_host,
            ids=self.ids,
            limits=limits,
            no_new_privs=not self.namespaced,
            stdin=stdin,
            timeout_s=timeout_s,
            max_output=max_output,
            kill_grace_s=o.kill_grace_s,
            stdout_sink=stdout_sink,
            spare_leader=self.namespaced,
        )
        return namespace.as_cwd_error(raw, work) if self.namespaced else raw

    def resolve(self, path: str) -> str:
        """A sandbox path as the sandboxed command sees it (namespace) or the host path (process)."""
        if self.namespaced:
            return posixpath.normpath(posixpath.join(self.workdir, path))
        if not path.startswith("/"):
            return os.path.normpath(os.path.join(self.host_workdir, path))
        p = posixpath.normpath(path)
        if self.workdir != "/" and (p == self.workdir or p.startswith(self.workdir + "/")):
            return os.path.normpath(self.host_workdir + p[len(self.workdir) :])
        return p

    # ---------------------------------------------------------------- files
    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        await fileops.write_file(self, path, data, mode)

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        return await fileops.read_file(self, path, max_bytes)

    async def upload_dir(self, local, remote: str) -> None:
        await fileops.upload_dir(self, local, remote)

    async def download_dir(self, remote: str, local) -> None:
        await fileops.download_dir(self, remote, local)

    def __repr__(self) -> str:
        return f"<LocalSandbox {self.id} {self.isolation} {'closed' if self._closed else 'open'}>"

"""Spawning a sandboxed command: rlimits, uid drop, output caps, timeout with group kill.

Runs on the event loop without threads: exit is watched through a pidfd, the pipes are
read non-blocking, and output past the cap is drained and dropped so a writer never
blocks and memory stays bounded.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import resource
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from miles_engine.sandbox.local import procscan, signals

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
POST_EXIT_DRAIN_S = 1.0  # how long pipes held by leftover background processes are still read
CHUNK = 1 << 16
_BACKGROUND: set[asyncio.Future] = set()


@dataclass(frozen=True)
class Limits:
    """Per-process rlimits (``None`` = unlimited) applied just before exec."""

    cpu_s: int | None = None
    address_space_bytes: int | None = None
    open_files: int | None = None
    file_size_bytes: int | None = None
    processes: int | None = None  # only meaningful under a dedicated uid

    def pairs(self) -> list[tuple[int, int, int]]:
        out: list[tuple[int, int, int]] = [(resource.RLIMIT_CORE, 0, 0)]
        if self.cpu_s:
            out.append((resource.RLIMIT_CPU, self.cpu_s, self.cpu_s + 5))
        for res, val in (
            (resource.RLIMIT_AS, self.address_space_bytes),
            (resource.RLIMIT_NOFILE, self.open_files),
            (resource.RLIMIT_FSIZE, self.file_size_bytes),
            (resource.RLIMIT_NPROC, self.processes),
        ):
            if val:
                out.append((res, val, val))
        # Never ask for more than the current hard limit (that would fail in the child).
        fixed = []
        for res, soft, hard in out:
            cur_hard = resource.getrlimit(res)[1]
            if cur_hard != resource.RLIM_INFINITY:
                hard = min(hard, cur_hard)
                soft = min(soft, hard)
            fixed.append((res, soft, hard))
        return fixed


def make_preexec(limits: Limits, *, no_new_privs: bool, die_with_parent: bool) -> Callable[[], None]:
    pairs = limits.pairs()  # computed in the parent: the child only makes syscalls
    reset_signals = signals.preexec_reset(signals.ignored())

    def preexec() -> None:
        reset_signals()
        for res, soft, hard in pairs:
            resource.setrlimit(res, (soft, hard))
        if die_with_parent:
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if no_new_privs:
            _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)

    return preexec


_PRLIMIT_FLAGS = {resource.RLIMIT_CORE: "--core", resource.RLIMIT_CPU: "--cpu", resource.RLIMIT_AS: "--as",
                  resource.RLIMIT_NOFILE: "--nofile", resource.RLIMIT_FSIZE: "--fsize",
                  resource.RLIMIT_NPROC: "--nproc"}
_wrapper_tools: tuple[str, str] | None | bool = False  # False: not looked up yet


def wrapper_tools() -> tuple[str, str] | None:
    """``(prlimit, setpriv)`` when both exist and setpriv knows ``--pdeathsig`` (util-linux ≥ 2.33)."""
    global _wrapper_tools
    if _wrapper_tools is False:
        found = [next((p for d in ("/usr/bin", "/bin") if os.access(p := f"{d}/{n}", os.X_OK)), None)
                 for n in ("prlimit", "setpriv")]
        ok = all(found)
        if ok:
            try:
                ok = "--pdeathsig" in subprocess.run([found[1], "--help"], capture_output=True, text=True,
                                                     timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                ok = False
        _wrapper_tools = (found[0], found[1]) if ok else None  # type: ignore[assignment]
    return _wrapper_tools  # type: ignore[return-value]


@dataclass(frozen=True)
class Spawn:
    """How to start a sandboxed command: the argv to exec and the extra ``Popen`` arguments."""

    argv: list[str]
    popen_kwargs: dict


def spawn_plan(argv: Sequence[str], limits: Limits, ids: tuple[int, int] | None, *, no_new_privs: bool,
               die_with_parent: bool) -> Spawn:
    """Apply rlimits, the uid drop and the parent-death signal with util-linux ``prlimit`` and
    ``setpriv`` exec'd in front of the command, so ``Popen`` needs no ``preexec_fn`` and no
    ``user``/``group``: CPython then starts the child with vfork (~2 ms) instead of a full fork of
    this process (50+ ms at the ~1 GB a training driver holds). Falls back to ``preexec_fn``
    where the tools are missing. setpriv sets the parent-death signal after its uid change
    (a credential change clears it), so it still holds for the command. Signals this process
    ignores are reset to their defaults first (:mod:`.signals`)."""
    tools = wrapper_tools()
    reset = signals.env_prefix(signals.ignored())
    if tools is None or reset is None:
        kw: dict = {"preexec_fn": make_preexec(limits, no_new_privs=no_new_privs, die_with_parent=die_with_parent)}
        if ids:
            kw.update(user=ids[0], group=ids[1], extra_groups=[])
        return Spawn(list(argv), kw)
    prlimit, setpriv = tools
    wrapped = [*reset, prlimit, *(f"{_PRLIMIT_FLAGS[res]}={soft}:{hard}" for res, soft, hard in limits.pairs()), "--"]
    if not (ids or die_with_parent or no_new_privs):
        return Spawn([*wrapped, *argv], {})
    wrapped.append(setpriv)
    if ids:
        wrapped += ["--reuid", str(ids[0]), "--regid", str(ids[1]), "--clear-groups"]
    if die_with_parent:
        wrapped += ["--pdeathsig", "KILL"]
    if no_new_privs:
        wrapped.append("--no-new-privs")
    return Spawn([*wrapped, "--", *argv], {})


@dataclass(frozen=True)
class RawResult:
    exit_code: int | None  # None when killed on timeout; 128+N when killed by signal N
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: bool
    duration_s: float


class _Collector:
    """Reads one pipe non-blocking; keeps at most ``cap`` bytes, drops (and counts) the rest."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, cap: int, sink: Callable[[bytes], None] | None):
        self.loop, self.fd, self.cap, self.sink = loop, fd, cap, sink
        self.buf = bytearray()
        self.total = 0
        self.eof: asyncio.Future[None] = loop.create_future()
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._on_readable)

    @property
    def truncated(self) -> bool:
        return self.total > self.cap

    def _on_readable(self) -> None:
        for _ in range(16):
            try:
                chunk = os.read(self.fd, CHUNK)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.stop()
                return
            room = self.cap - self.total
            self.total += len(chunk)
            if room > 0:
                piece = chunk if len(chunk) <= room else chunk[:room]
                if self.sink is not None:
                    self.sink(piece)
                else:
                    self.buf += piece

    def stop(self) -> None:
        if not self.eof.done():
            self.loop.remove_reader(self.fd)
            self.eof.set_result(None)


class _Feeder:
    """Writes ``data`` to a pipe non-blocking, then closes it; gives up quietly on EPIPE."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pipe, data: bytes):
        self.loop, self.pipe, self.view, self.fd = loop, pipe, memoryview(data), pipe.fileno()
        os.set_blocking(self.fd, False)
        if self.view:
            loop.add_writer(self.fd, self._on_writable)
        else:
            self.close()

    def _on_writable(self) -> None:
        try:
            n = os.write(self.fd, self.view[:CHUNK])
        except BlockingIOError:
            return
        except OSError:
            self.close()
            return
        self.view = self.view[n:]
        if not self.view:
            self.close()

    def close(self) -> None:
        if not self.pipe.closed:
            self.loop.remove_writer(self.fd)
            self.pipe.close()


def _later(fut: asyncio.Future) -> None:
    fut = asyncio.ensure_future(fut)
    _BACKGROUND.add(fut)
    fut.add_done_callback(_BACKGROUND.discard)


async def _kill_leader_after(pgid: int, exited: asyncio.Future) -> None:
    """Give nsenter a moment to reap its killed child, then kill whatever is left."""
    await asyncio.wait({exited}, timeout=1.0)
    procscan.killpg(pgid, signal.SIGKILL)


async def wait_exit(pid: int) -> int:
    """Wait for our child ``pid`` to exit and reap it; returns its wait status."""
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = -1
    try:
        if pidfd >= 0:
            fut: asyncio.Future[None] = loop.create_future()
            loop.add_reader(pidfd, lambda: fut.done() or fut.set_result(None))
            try:
                await fut
            finally:
                loop.remove_reader(pidfd)
        while True:
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                return 0
            if done:
                return status
            await asyncio.sleep(0.01)
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def exit_code_of(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


async def run(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | None,
    ids: tuple[int, int] | None,
    limits: Limits,
    no_new_privs: bool,
    stdin: bytes | None,
    timeout_s: float,
    max_output: int,
    kill_grace_s: float,
    stdout_sink: Callable[[bytes], None] | None = None,
    spare_leader: bool = False,
) -> RawResult:
    """Run ``argv`` in a new session; never raises because of what the command did."""
    loop = asyncio.get_running_loop()
    start = time.monotonic()
    plan = spawn_plan(argv, limits, ids, no_new_privs=no_new_privs, die_with_parent=True)
    try:
        proc = await asyncio.to_thread(  # fork+exec off the loop: 64 sandboxes start in parallel
            subprocess.Popen,
            plan.argv,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
            **plan.popen_kwargs,
        )
    except OSError as exc:  # report like a shell (or env -C) would
        if cwd is not None and exc.filename == cwd:
            code, msg = 125, f"cannot change directory to '{cwd}': {exc.strerror or exc}\n"
        else:
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            msg = f"{argv[0] if argv else ''}: {exc.strerror or exc}\n"
        return RawResult(code, b"", msg.encode(), False, False, time.monotonic() - start)
    assert proc.stdout is not None and proc.stderr is not None
    out = _Collector(loop, proc.stdout.fileno(), max_output, stdout_sink)
    err = _Collector(loop, proc.stderr.fileno(), max_output, None)
    feeder = _Feeder(loop, proc.stdin, stdin) if proc.stdin is not None and stdin is not None else None
    exited = asyncio.ensure_future(wait_exit(proc.pid))
    timed_out = False
    try:
        done, _ = await asyncio.wait({exited}, timeout=max(0.0, start + timeout_s - time.monotonic()))
        if not done:
            timed_out = True
            if spare_leader:
                procscan.kill_group_but_leader(proc.pid, signal.SIGTERM)
            else:
                procscan.killpg(proc.pid, signal.SIGTERM)
            await asyncio.wait({exited}, timeout=kill_grace_s)
            if spare_leader:
                procscan.kill_group_but_leader(proc.pid, signal.SIGKILL)
                await asyncio.wait({exited}, timeout=1.0)
            procscan.killpg(proc.pid, signal.SIGKILL)  # the whole group, even if the leader already left
            await asyncio.wait({exited}, timeout=10)
        status = await exited
        drain = 0.2 if timed_out else POST_EXIT_DRAIN_S
        await asyncio.wait({out.eof, err.eof}, timeout=drain)
    except BaseException:  # cancelled: nothing of this command may keep running
        if spare_leader:
            procscan.kill_group_but_leader(proc.pid, signal.SIGKILL)
            _later(_kill_leader_after(proc.pid, exited))
        else:
            procscan.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        out.stop()
        err.stop()
        if feeder is not None:
            feeder.close()
        proc.stdout.close()
        proc.stderr.close()
        if not exited.done():  # cancelled: the group is killed; reap it in the background
            _later(exited)
        if proc.returncode is None:
            proc.returncode = -1  # reaped by wait_exit; keeps Popen.__del__ quiet
    return RawResult(
        None if timed_out else exit_code_of(status),
        bytes(out.buf),
        bytes(err.buf),
        timed_out,
        out.truncated or err.truncated,
        time.monotonic() - start,
    )


async def reap_popen(proc: subprocess.Popen[bytes], timeout: float) -> None:
    if proc.returncode is not None:
        return
    try:
        status = await asyncio.wait_for(wait_exit(proc.pid), timeout)
        proc.returncode = exit_code_of(status)
    except TimeoutError:
        pass


async def read_line(pipe, timeout: float) -> bytes:
    loop = asyncio.get_running_loop()
    fd = pipe.fileno()
    os.set_blocking(fd, False)
    data = bytearray()
    done: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return
        data.extend(chunk)
        if not chunk or b"\n" in chunk:
            if not done.done():
                done.set_result(None)

    loop.add_reader(fd, on_readable)
    try:
        await asyncio.wait_for(done, timeout)
    except TimeoutError:
        pass
    finally:
        loop.remove_reader(fd)
    return bytes(data)

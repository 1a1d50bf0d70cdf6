"""The namespace's PID 1 as the sandbox's exec server (bubblewrap tier).

PID 1 is a bash loop (``INIT_SCRIPT``) already inside every namespace with the sandbox's
uid, no capabilities and no-new-privs (bwrap set them up), so a command it forks needs no
``nsenter`` + ``setpriv`` chain from the host: an exec costs a bash fork and the command
(PID 1 runs with job control, so each command leads its own process group without a
``setsid`` exec). Requests are NUL-separated fields on PID 1's stdin; PID 1 answers with lines
on its stdout::

    run  ID CWD STDIN OUT ERR ULIMITS N ENV... N ARGV...  ->  pid ID PID
    wait ID PID                                           ->  exit ID STATUS
    kill SIGNAL PID                                       (the command's process group)
    reset NONCE                                           ->  miles-reset-done NONCE

The host watches the command's exit with a pidfd (sandboxed code cannot kill the host, as
it could kill a helper inside), then asks for the status with ``wait``, which PID 1 answers
at once from the status bash kept when it reaped the child.

Output goes through FIFOs the host creates in a control dir bound read-only at
``CTL_DIR``. Sandboxed code can reach PID 1's pipes through /proc and inject requests,
but PID 1 never evaluates text as code (every number is checked before arithmetic), a
command it forks gets the same rlimits as PID 1 at most (its hard limits are the
sandbox's), and a desynchronised stream only breaks this sandbox's own commands; the
warm pool's reset is confirmed by the kernel's view of PID 1's children, not by the
answer alone.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

from miles_engine.errors import SandboxError
from miles_engine.sandbox.local import process
from miles_engine.sandbox.local.initscript import (
    CTL_DIR,
    RESET_DONE,
    encode_field,
    ulimit_args,
)

KILL_WAIT_S = 1.0


class _StdinFeeder(process._Feeder):
    """Feeds a command's stdin FIFO; its end-of-data close waits until the command has
    opened the FIFO (an open for reading blocks while no writer exists)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pipe, data: bytes, started: asyncio.Future[int]) -> None:
        self.started = started
        super().__init__(loop, pipe, data)

    def close(self) -> None:
        if not self.pipe.closed:
            self.loop.remove_writer(self.fd)
        if self.started.done():
            self.close_now()
        elif not getattr(self, "_deferred", False):
            self._deferred = True
            self.started.add_done_callback(lambda _f: self.close_now())

    def close_now(self) -> None:
        super().close()


class _Command:
    __slots__ = ("pid", "started", "exited", "kill_when_started", "pidfd")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.pid: int | None = None  # in the sandbox's PID namespace
        self.started: asyncio.Future[int] = loop.create_future()
        self.exited: asyncio.Future[int] = loop.create_future()
        self.kill_when_started = False
        self.pidfd = -1


def host_pid_of_child(pid1: int, ns_pid: int) -> int | None:
    """The host pid of PID 1's child whose pid in the sandbox namespace is ``ns_pid``."""
    try:
        with open(f"/proc/{pid1}/task/{pid1}/children") as f:
            kids = f.read().split()
    except OSError:
        return None
    for kid in kids:
        try:
            with open(f"/proc/{kid}/status") as f:
                for line in f:
                    if line.startswith("NSpid:"):
                        if line.split()[-1] == str(ns_pid):
                            return int(kid)
                        break
        except OSError:
            continue
    return None


class InitChannel:
    """Requests to a sandbox's PID 1 and the dispatch of its answers (see module doc)."""

    def __init__(self, init: subprocess.Popen[bytes], pid1: int, ctl_host_dir: str,
                 ids: tuple[int, int] | None) -> None:
        assert init.stdin is not None and init.stdout is not None
        self.loop = asyncio.get_running_loop()
        self.init, self.pid1, self.ctl, self.ids = init, pid1, ctl_host_dir, ids
        self._out = init.stdout.fileno()
        self._buf = b""
        self._commands: dict[str, _Command] = {}
        self._resets: dict[str, asyncio.Future[None]] = {}
        self.closed = False
        os.set_blocking(self._out, False)
        self.loop.add_reader(self._out, self._on_readable)

    # ---------------------------------------------------------------- plumbing
    def _send(self, *fields: str | bytes) -> None:
        if self.closed or self.init.stdin is None or self.init.poll() is not None:
            raise SandboxError("the sandbox's init process is gone")
        try:
            self.init.stdin.write(b"".join(encode_field(f) for f in fields))
            self.init.stdin.flush()
        except (OSError, ValueError) as exc:
            raise SandboxError(f"the sandbox's init process is gone: {exc}") from None

    def _on_readable(self) -> None:
        try:
            chunk = os.read(self._out, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
            return
        *lines, self._buf = (self._buf + chunk).split(b"\n")
        for line in lines:
            self._dispatch(line.decode(errors="replace").split())

    def _dispatch(self, words: list[str]) -> None:
        if len(words) == 3 and words[0] in ("pid", "exit") and words[2].isdigit():
            cmd = self._commands.get(words[1])
            if cmd is None:
                return
            value = int(words[2])
            if words[0] == "pid":
                cmd.pid = value
                if not cmd.started.done():
                    cmd.started.set_result(value)
                if cmd.kill_when_started:
                    self.kill(value, signal.SIGKILL)
                self._watch(words[1], cmd)
            else:
                self._unwatch(cmd)
                if not cmd.exited.done():
                    cmd.exited.set_result(value)
        elif len(words) == 2 and words[0] == RESET_DONE:
            fut = self._resets.pop(words[1], None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _watch(self, cid: str, cmd: _Command) -> None:
        """PID 1 forked the command: watch its exit from here (a pidfd), then ask PID 1 for
        the status it reaped. PID 1 never blocks on a running command, and sandboxed code
        cannot kill the watcher. Not among PID 1's children any more: it already exited."""
        assert cmd.pid is not None
        host_pid = host_pid_of_child(self.pid1, cmd.pid)
        try:
            cmd.pidfd = os.pidfd_open(host_pid) if host_pid is not None else -1
        except OSError:
            cmd.pidfd = -1
        if cmd.pidfd < 0:
            self._ask_status(cid, cmd.pid)
            return

        def on_exit() -> None:
            self._unwatch(cmd)
            self._ask_status(cid, cmd.pid or 0)

        self.loop.add_reader(cmd.pidfd, on_exit)

    def _unwatch(self, cmd: _Command) -> None:
        if cmd.pidfd >= 0:
            self.loop.remove_reader(cmd.pidfd)
            os.close(cmd.pidfd)
            cmd.pidfd = -1

    def _ask_status(self, cid: str, pid: int) -> None:
        try:
            self._send("wait", cid, str(pid))
        except SandboxError:
            pass  # close() fails the waiters

    def close(self) -> None:
        """Stop reading (PID 1 gone or the sandbox closing); pending waiters fail."""
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self._out)
        for cmd in self._commands.values():
            self._unwatch(cmd)
            for fut in (cmd.started, cmd.exited):
                if not fut.done():
                    fut.set_exception(SandboxError("the sandbox's init process is gone"))
                    fut.exception()  # retrieved: nobody may be waiting any more
        for fut in self._resets.values():
            if not fut.done():
                fut.cancel()

    def kill(self, pid: int, sig: signal.Signals) -> None:
        try:
            self._send("kill", sig.name.removeprefix("SIG"), str(pid))
        except SandboxError:
            pass  # PID 1 gone: the kernel has killed everything in the namespace

    async def reset(self, timeout_s: float) -> bool:
        """Ask PID 1 to kill every other process and remove IPC objects; True when it answered
        with our nonce (the caller still checks PID 1's children)."""
        nonce = secrets.token_hex(8)
        fut = self._resets[nonce] = self.loop.create_future()
        try:
            self._send("reset", nonce)
            await asyncio.wait_for(fut, timeout_s)
            return True
        except (SandboxError, TimeoutError, asyncio.CancelledError):
            if asyncio.current_task() is not None and asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise
            return False
        finally:
            self._resets.pop(nonce, None)

    # ---------------------------------------------------------------- run
    async def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        limits: process.Limits,
        stdin: bytes | None,
        timeout_s: float,
        max_output: int,
        kill_grace_s: float,
        stdout_sink: Callable[[bytes], None] | None = None,
    ) -> process.RawResult:
        """Run ``argv`` through PID 1, as :func:`process.run` does through nsenter."""
        start = time.monotonic()
        cid = secrets.token_hex(8)
        paths = {k: os.path.join(self.ctl, f"{cid}.{k}") for k in ("out", "err", "in")}
        fds: list[int] = []
        feeder: _StdinFeeder | None = None
        cmd = _Command(self.loop)
        self._commands[cid] = cmd
        collectors: list[process._Collector] = []
        timed_out = False
        try:
            for k in ("out", "err"):
                os.mkfifo(paths[k], 0o600)
                if self.ids:
                    os.chown(paths[k], *self.ids)
            # Our own (unused) writer on each FIFO: until the command has opened its end, a
            # reader would otherwise see EOF at once; closed when the command has exited.
            readers = [os.open(paths[k], os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC) for k in ("out", "err")]
            fds += readers
            holders = [os.open(paths[k], os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC) for k in ("out", "err")]
            fds += holders
            stdin_path, stdin_keeper = "/dev/null", None
            if stdin is not None:  # a FIFO, not a file: the command sees a pipe, as with nsenter
                os.mkfifo(paths["in"], 0o600)
                if self.ids:
                    os.chown(paths["in"], *self.ids)
                # Our reader keeps buffered data alive until the command has opened its end
                # (PID 1's helper opens it before it answers "pid"); then it is closed.
                stdin_keeper = os.open(paths["in"], os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                fds.append(stdin_keeper)
                writer = os.fdopen(os.open(paths["in"], os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC), "wb", buffering=0)
                feeder = _StdinFeeder(self.loop, writer, stdin, cmd.started)
                stdin_path = f"{CTL_DIR}/{cid}.in"
            collectors = [process._Collector(self.loop, readers[0], max_output, stdout_sink),
                          process._Collector(self.loop, readers[1], max_output, None)]
            env_fields = [f"{k}={v}" for k, v in env.items()]
            self._send("run", cid, cwd, stdin_path, f"{CTL_DIR}/{cid}.out", f"{CTL_DIR}/{cid}.err",
                       ulimit_args(limits), str(len(env_fields)), *env_fields, str(len(argv)), *argv)
            if stdin_keeper is not None:
                def release(_f: asyncio.Future[int], fd: int = stdin_keeper) -> None:
                    if fd in fds:
                        fds.remove(fd)
                        os.close(fd)
                cmd.started.add_done_callback(release)
            try:
                status = await asyncio.wait_for(asyncio.shield(cmd.exited), max(0.0, start + timeout_s - time.monotonic()))
            except TimeoutError:
                timed_out = True
                status = await self._stop(cmd, kill_grace_s)
            for fd in holders:
                os.close(fd)
                fds.remove(fd)
            await asyncio.wait({c.eof for c in collectors}, timeout=0.2 if timed_out else process.POST_EXIT_DRAIN_S)
        except BaseException:
            if cmd.pid is not None:
                self.kill(cmd.pid, signal.SIGKILL)
            else:
                cmd.kill_when_started = True  # the pid answer may still come
            raise
        finally:
            for c in collectors:
                c.stop()
            if feeder is not None:
                feeder.close_now()
            while fds:
                os.close(fds.pop())
            for p in paths.values():
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            if cmd.exited.done() or self.closed:
                self._commands.pop(cid, None)
            else:  # still running (cancelled): keep it until its exit (or PID 1's death)
                cmd.exited.add_done_callback(lambda _f: self._commands.pop(cid, None))
        out, err = collectors
        return process.RawResult(
            None if timed_out else (status if status is not None else None),
            bytes(out.buf),
            bytes(err.buf),
            timed_out,
            out.truncated or err.truncated,
            time.monotonic() - start,
        )

    async def _stop(self, cmd: _Command, grace_s: float) -> int | None:
        """Timed out: TERM the command's process group, KILL after the grace period."""
        try:
            pid = await asyncio.wait_for(asyncio.shield(cmd.started), KILL_WAIT_S)
        except (TimeoutError, SandboxError):
            cmd.kill_when_started = True
            return None
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, KILL_WAIT_S)):
            self.kill(pid, sig)
            done, _ = await asyncio.wait({cmd.exited}, timeout=wait_s)
            if done:
                return None if cmd.exited.exception() else cmd.exited.result()
        return None

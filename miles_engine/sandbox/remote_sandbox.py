"""One remote sandbox, with the local backend's semantics, over a provider's minimal transport.

A provider adapter (E2B, Daytona, Modal...) implements :class:`Transport`: run one ``sh``
script, put/get one file, tell whether the box is alive, destroy it. :class:`RemoteSandbox`
builds the whole :class:`~miles_engine.sandbox.protocol.Sandbox` protocol on top of it:

- ``exec`` sends the wrapper of :mod:`miles_engine.sandbox.remote_exec` exactly once. If the
  provider refused the request (:class:`~miles_engine.sandbox.remote.QuotaError`: nothing ran)
  it backs off and asks again; if the stream dropped mid-command (:class:`StreamLost`) it
  collects the result the wrapper leaves in files instead of re-running the command.
- File operations stage bytes under :data:`~miles_engine.sandbox.remote_exec.STAGING_ROOT`
  with the transport's file API and move them into place with a small script of our own;
  both are idempotent, so both are retried.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import posixpath
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

from miles_engine.errors import SandboxError, SandboxUnsupportedError
from miles_engine.sandbox.protocol import (
    ExecResult,
    IsolationLevel,
    SandboxSpec,
)
from miles_engine.sandbox.remote import (
    QuotaError,
    TransientError,
    decode_output,
    retry_idempotent,
)
from miles_engine.sandbox.remote_exec import (
    EXEC_ROOT,
    STAGING_ROOT,
    ExecReply,
    command_argv,
    exec_script,
    parse_reply,
    parse_status,
    q,
)
from miles_engine.sandbox.remote_transport import (
    RemoteExecOptions,
    StreamLost,
    Transport,
)
from miles_engine.sandbox.tarball import pack_dir, pack_files, unpack_into

OWNED_SCRIPT_TIMEOUT_S = 300.0  # our own file-moving scripts
_REPLY_SLACK_S = 30.0  # on top of timeout + grace: how long the SDK call may take end to end


class RemoteSandbox:
    """A live remote sandbox. Paths are sandbox paths; relative ones resolve against the
    spec's ``workdir``. Commands run as root (``exec(user=...)`` accepts only root)."""

    def __init__(
        self,
        transport: Transport,
        spec: SandboxSpec,
        *,
        sandbox_id: str,
        provider: str,
        isolation: IsolationLevel,
        options: RemoteExecOptions,
        on_close=None,
    ) -> None:
        self.transport = transport
        self.spec = spec
        self.id = sandbox_id
        self.provider = provider
        self.isolation: IsolationLevel = isolation
        self.opts = options
        self.workdir = posixpath.normpath(spec.workdir or "/")
        self._closed = False
        self._close_task: asyncio.Task[None] | None = None
        self._on_close = on_close
        self._trash: list[str] = []  # exec dirs and staged files to remove with the next command

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Make the work dirs and write the spec's files (called once by the backend)."""
        dirs = [EXEC_ROOT, STAGING_ROOT, self.workdir, *self.spec.paths]
        script = "set -e; mkdir -p -- " + " ".join(q(d) for d in dirs)
        if self.spec.files:
            payload = pack_files({self.resolve(p): d for p, d in self.spec.files.items()})
            staged = await self._stage(payload, "seed.tar")
            script += f"; tar -x --no-same-owner -f {q(staged)} -C /; rm -f -- {q(staged)}"
        await self._owned(script + "\n", "preparing the sandbox")

    async def alive(self) -> bool:
        if self._closed:
            return False
        try:
            return await self.transport.is_alive()
        except (SandboxError, OSError):
            return False

    async def close(self) -> None:
        """Destroy the sandbox (retried: idempotent). Idempotent itself."""
        if self._close_task is None:
            self._closed = True
            self._close_task = asyncio.ensure_future(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        try:
            await retry_idempotent(self.transport.destroy, what=f"{self.provider}: deleting sandbox {self.id}",
                                   policy=self.opts.retry)
        finally:
            if self._on_close is not None:
                self._on_close(self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")

    def resolve(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.workdir, path))

    # ---------------------------------------------------------------- exec
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
        argv = command_argv(cmd)
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if max_output_bytes is not None and max_output_bytes < 0:
            raise ValueError(f"max_output_bytes must be >= 0, got {max_output_bytes}")
        if user not in (None, "root", "0"):
            raise SandboxUnsupportedError(f"the {self.provider} sandbox runs commands as root only, not as '{user}'")
        self._check_open()
        timeout = self.opts.default_timeout_s if timeout_s is None else timeout_s
        cap = self.opts.max_output_bytes if max_output_bytes is None else max_output_bytes
        stdin_path = await self._stage(stdin, "stdin") if stdin is not None else None
        exec_dir = f"{EXEC_ROOT}/{secrets.token_hex(8)}"
        script = exec_script(
            exec_dir,
            argv,
            cwd=self.resolve(cwd) if cwd else self.workdir,
            env={**self.spec.env, **(env or {})},
            timeout_s=timeout,
            grace_s=self.opts.kill_grace_s,
            cap=cap,
            stdin_path=stdin_path,
            cleanup=self._take_trash(),
        )
        budget = timeout + self.opts.kill_grace_s + _REPLY_SLACK_S
        t0 = time.monotonic()
        try:
            reply = await self._dispatch_once(script, budget)
        except StreamLost:
            reply = await self._collect(exec_dir, cap, deadline=t0 + budget)
        self._trash.append(exec_dir)
        if stdin_path:
            self._trash.append(stdin_path)
        return ExecResult(
            exit_code=reply.exit_code,
            stdout=decode_output(reply.stdout),
            stderr=decode_output(reply.stderr),
            timed_out=reply.timed_out,
            truncated=reply.truncated,
            duration_s=round(time.monotonic() - t0, 6),
            isolation=self.isolation,
        )

    async def _dispatch_once(self, script: str, budget: float) -> ExecReply:
        """Send the model's command once. Only a refusal (nothing ran) is asked again."""
        attempt = 0
        while True:
            attempt += 1
            try:
                out = await self.transport.run_script(script, timeout_s=budget)
                return parse_reply(out, what=f"{self.provider} sandbox {self.id}: exec")
            except QuotaError as exc:
                if attempt >= self.opts.retry.quota_attempts:
                    raise SandboxError(
                        f"{self.provider} sandbox {self.id}: exec refused {attempt} times, the provider is "
                        f"throttling / over quota ({exc}); lower the concurrency or raise the quota"
                    ) from exc
                await asyncio.sleep(self.opts.retry.delay(attempt))

    async def _collect(self, exec_dir: str, cap: int, *, deadline: float) -> ExecReply:
        """The result a command's wrapper left behind after the stream carrying it dropped."""
        delay = 0.5
        while True:
            try:
                status = await self.transport.get_file(f"{exec_dir}/status")
                break
            except (FileNotFoundError, TransientError):
                pass
            if time.monotonic() >= deadline:
                raise SandboxError(
                    f"{self.provider} sandbox {self.id}: the connection to a running command dropped and its "
                    f"result never appeared in {exec_dir}; the command was not re-run"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        rc, timed_out, osz, esz = parse_status(status.decode())
        out = await self._get(f"{exec_dir}/out.cap", "collecting stdout")
        err = await self._get(f"{exec_dir}/err.cap", "collecting stderr")
        return ExecReply(None if timed_out else rc, timed_out, out[:cap], err[:cap], osz, esz)

    # ---------------------------------------------------------------- files
    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self._check_open()
        payload = data.encode() if isinstance(data, str) else bytes(data)
        target = self.resolve(path)
        staged = await self._stage(payload, "file")
        await self._owned(
            f'set -e; mkdir -p -- "$(dirname -- {q(target)})"; cat -- {q(staged)} > {q(target)}; '
            f"chmod {format(mode & 0o7777, 'o')} -- {q(target)}; rm -f -- {q(staged)}\n",
            f"write_file '{path}'",
        )

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        self._check_open()
        cap = self.opts.max_transfer_mb << 20
        want = cap + 1 if max_bytes is None else max(0, max_bytes)
        target = self.resolve(path)
        out = await self._owned(
            f'p={q(target)}; if [ -d "$p" ]; then echo MILES-ISDIR; exit 0; fi; '
            f'[ -e "$p" ] || {{ echo MILES-MISSING; exit 0; }}; '
            f'echo MILES-DATA; head -c {want} -- "$p" | base64\n',  # head's own error breaks the base64
            f"read_file '{path}'",
        )
        marker, _, body = out.partition("\n")
        if marker == "MILES-MISSING":
            raise FileNotFoundError(f"no such file in sandbox {self.id}: {path}")
        if marker == "MILES-ISDIR":
            raise IsADirectoryError(f"is a directory in sandbox {self.id}: {path}")
        try:
            if marker != "MILES-DATA":
                raise ValueError(marker)
            data = base64.b64decode("".join(body.split()), validate=True)
        except (ValueError, binascii.Error):
            raise SandboxError(f"read_file '{path}' in sandbox {self.id} failed: {out.strip()[-300:]}") from None
        if max_bytes is None and len(data) > cap:
            raise SandboxError(
                f"read_file '{path}': larger than max_transfer_mb={self.opts.max_transfer_mb}; pass max_bytes"
            )
        return data

    async def upload_dir(self, local: Path | str, remote: str) -> None:
        self._check_open()
        local = Path(local)
        if not local.is_dir():
            raise NotADirectoryError(f"upload_dir: '{local}' is not a directory")
        payload = await asyncio.to_thread(pack_dir, local)
        staged = await self._stage(payload, "upload.tar")
        target = self.resolve(remote)
        await self._owned(
            f"set -e; mkdir -p -- {q(target)}; tar -x --no-same-owner -f {q(staged)} -C {q(target)}; "
            f"rm -f -- {q(staged)}\n",
            f"upload_dir to '{remote}'",
        )

    async def download_dir(self, remote: str, local: Path | str) -> None:
        self._check_open()
        local = Path(local)
        target = self.resolve(remote)
        staged = f"{STAGING_ROOT}/{secrets.token_hex(8)}.download.tar"
        out = await self._owned(
            f'p={q(target)}; if [ ! -d "$p" ]; then [ -e "$p" ] && echo MILES-NOTDIR || echo MILES-MISSING; exit 0; fi; '
            f'tar -c -f {q(staged)} -C "$p" . 2>&1; echo "MILES-TAR $?"; wc -c < {q(staged)}\n',
            f"download_dir from '{remote}'",
        )
        if "MILES-MISSING" in out:
            raise FileNotFoundError(f"no such directory in sandbox {self.id}: {remote}")
        if "MILES-NOTDIR" in out:
            raise NotADirectoryError(f"not a directory in sandbox {self.id}: {remote}")
        lines = out.strip().splitlines()
        status = next((line for line in lines if line.startswith("MILES-TAR ")), "MILES-TAR ?")
        if status.split()[1] not in ("0", "1"):  # tar exits 1 when a file changed while read
            raise SandboxError(f"download_dir '{remote}' in sandbox {self.id} failed: {out.strip()[-300:]}")
        if int(lines[-1].strip()) > self.opts.max_transfer_mb << 20:
            self._trash.append(staged)
            raise SandboxError(f"download_dir '{remote}': more than max_transfer_mb={self.opts.max_transfer_mb}")
        payload = await self._get(staged, f"download_dir from '{remote}'")
        self._trash.append(staged)
        await asyncio.to_thread(unpack_into, payload, local)

    # ---------------------------------------------------------------- plumbing
    def _take_trash(self) -> list[str]:
        trash, self._trash = self._trash, []
        return trash

    async def _stage(self, data: bytes, suffix: str) -> str:
        path = f"{STAGING_ROOT}/{secrets.token_hex(8)}.{suffix}"
        await retry_idempotent(lambda: self.transport.put_file(path, data),
                               what=f"{self.provider} sandbox {self.id}: uploading {len(data)} bytes",
                               policy=self.opts.retry)
        return path

    async def _get(self, path: str, what: str) -> bytes:
        return await retry_idempotent(lambda: self.transport.get_file(path),
                                      what=f"{self.provider} sandbox {self.id}: {what}", policy=self.opts.retry)

    async def _owned(self, script: str, what: str) -> str:
        """Run one of our own idempotent scripts (retried on transient failures); raise
        :class:`SandboxError` with its output when it exits non-zero."""
        self._check_open()
        trash = self._take_trash()
        if trash:
            script = f"rm -rf -- {' '.join(q(p) for p in trash)} 2>/dev/null\n" + script
        # Login shells may print banners first: the body starts after our own marker.
        wrapped = f"echo MILES-BEGIN; ( {script}) 2>&1; echo \"MILES-RC $?\""
        out = await retry_idempotent(
            lambda: self.transport.run_script(wrapped, timeout_s=OWNED_SCRIPT_TIMEOUT_S),
            what=f"{self.provider} sandbox {self.id}: {what}",
            policy=self.opts.retry,
        )
        out = out.split("MILES-BEGIN\n", 1)[-1]
        body, _, status = out.rstrip("\n").rpartition("\n")
        if status.strip() != "MILES-RC 0":
            raise SandboxError(f"{what} in sandbox {self.id} failed: {out.strip()[-300:] or '(no output)'}")
        return body + ("\n" if body else "")

    def __repr__(self) -> str:
        return f"<RemoteSandbox {self.provider} {self.id} {'closed' if self._closed else 'open'}>"


async def start_remote_sandbox(
    transport: Transport,
    spec: SandboxSpec,
    *,
    sandbox_id: str,
    provider: str,
    isolation: IsolationLevel,
    options: RemoteExecOptions,
    live: set[RemoteSandbox],
) -> RemoteSandbox:
    """Wrap a freshly created provider sandbox, prepare it, and track it in ``live`` until it
    closes. A sandbox whose preparation fails is destroyed before the error propagates."""
    sb = RemoteSandbox(
        transport, spec, sandbox_id=sandbox_id, provider=provider, isolation=isolation, options=options,
        on_close=live.discard,
    )
    live.add(sb)
    try:
        await sb.start()
    except BaseException:
        await asyncio.shield(sb.close())
        raise
    return sb


async def close_all(live: set[RemoteSandbox]) -> None:
    if live:
        await asyncio.gather(*(sb.close() for sb in list(live)), return_exceptions=True)


def new_sandbox_id(provider: str) -> str:
    """Our id for a sandbox, known before the provider call (it is the ``miles.sandbox``
    label and, where the provider has one, the idempotency key): lowercase, digits, '-'."""
    return f"miles-{provider}-{secrets.token_hex(6)}"

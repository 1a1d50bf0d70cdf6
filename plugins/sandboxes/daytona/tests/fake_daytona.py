"""A faithful fake of the part of the ``daytona`` SDK (0.226.1) the adapter calls.

The SDK's own parameter, config, query and image classes and its exception classes; the
client and sandbox objects mimic ``AsyncDaytona`` / ``AsyncSandbox`` with Daytona's quirks:
``process.exec`` runs the command under a shell and returns ``ExecuteResponse(exit_code,
result)`` with stdout and stderr *merged*; a client-side timeout raises ``DaytonaTimeoutError``;
``fs.download_file`` raises ``DaytonaFileNotFoundError``; a deleted sandbox answers
``DaytonaNotFoundError``. Commands run for real in a
:class:`~miles_engine.testing.remote_fakes.LocalBox`.

Failure injection: ``cloud.fail(op, exc, times=1)`` (ops: create, create_lost_answer, exec,
exec_after_start, upload, download, list, delete).
"""

from __future__ import annotations

import asyncio
import secrets
import types
from dataclasses import dataclass, field
from typing import Any

from daytona import (
    CreateSandboxFromImageParams,
    CreateSandboxFromSnapshotParams,
    DaytonaAuthenticationError,
    DaytonaConfig,
    DaytonaNotFoundError,
    DaytonaTimeoutError,
    ExecuteResponse,
    Image,
    ListSandboxesQuery,
    Resources,
    SandboxState,
)
from daytona.common.errors import DaytonaFileNotFoundError

from miles_engine.testing.remote_fakes import BoxGone, LocalBoxes


@dataclass
class FakeCloud:
    api_key: str = "dtn_test_key_0123456789"
    boxes: LocalBoxes = field(default_factory=LocalBoxes)
    sandboxes: dict[str, FakeSandbox] = field(default_factory=dict)
    faults: dict[str, list[BaseException]] = field(default_factory=dict)
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def fail(self, op: str, exc: BaseException, times: int = 1) -> None:
        self.faults.setdefault(op, []).extend([exc] * times)

    def maybe_fail(self, op: str) -> None:
        queue = self.faults.get(op)
        if queue:
            raise queue.pop(0)

    def sdk(self) -> types.SimpleNamespace:
        cloud = self

        class AsyncDaytona(FakeAsyncDaytona):
            _cloud = cloud

        return types.SimpleNamespace(
            AsyncDaytona=AsyncDaytona, DaytonaConfig=DaytonaConfig, Resources=Resources, Image=Image,
            CreateSandboxFromImageParams=CreateSandboxFromImageParams,
            CreateSandboxFromSnapshotParams=CreateSandboxFromSnapshotParams, ListSandboxesQuery=ListSandboxesQuery,
        )

    async def aclose(self) -> None:
        await self.boxes.aclose()


class FakeAsyncDaytona:
    _cloud: FakeCloud

    def __init__(self, config: DaytonaConfig | None = None) -> None:
        self._key = config.api_key if config else None
        self.closed = False

    def _auth(self) -> None:
        if self._key != self._cloud.api_key:
            raise DaytonaAuthenticationError("Unauthorized: invalid API key", status_code=401)

    async def create(self, params=None, *, timeout: float = 60, on_snapshot_create_logs=None) -> FakeSandbox:
        cloud = self._cloud
        self._auth()
        cloud.calls.append(("create", params))
        cloud.maybe_fail("create")
        box = await cloud.boxes.start(network=not params.network_block_all)
        sb = FakeSandbox(cloud, "sb-" + secrets.token_hex(8), box, dict(params.labels or {}))
        cloud.sandboxes[sb.id] = sb
        cloud.maybe_fail("create_lost_answer")
        return sb

    async def list(self, query: ListSandboxesQuery | None = None, request_timeout: float | None = None):
        self._auth()
        self._cloud.maybe_fail("list")
        want = (query.labels if query else None) or {}
        for sb in list(self._cloud.sandboxes.values()):  # deleted ones linger as 'destroyed' for a while
            if all(sb.labels.get(k) == v for k, v in want.items()):
                yield sb

    async def close(self) -> None:
        self.closed = True


class _Process:
    def __init__(self, sb: FakeSandbox) -> None:
        self._sb = sb

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout: int | None = None) -> ExecuteResponse:
        sb = self._sb
        sb._cloud.calls.append(("exec", command))
        sb._cloud.maybe_fail("exec")
        sb._check()
        argv = ["/bin/sh", "-c", command]
        drop = sb._cloud.faults.get("exec_after_start")
        if drop:
            exc = drop.pop(0)
            sb._background.append(asyncio.ensure_future(sb.box.run(argv, cwd=cwd, env=env, timeout_s=timeout or 3600)))
            await asyncio.sleep(0.05)
            raise exc
        try:
            raw = await sb.box.run(argv, cwd=cwd, env=env, timeout_s=timeout or 3600)
        except BoxGone:
            raise DaytonaNotFoundError(f"Sandbox {sb.id} not found", status_code=404) from None
        if raw.timed_out:
            raise DaytonaTimeoutError(f"Request timed out after {timeout} seconds")
        merged = (raw.stdout + raw.stderr).decode(errors="replace")
        return ExecuteResponse(exit_code=raw.exit_code, result=merged)


class _FileSystem:
    def __init__(self, sb: FakeSandbox) -> None:
        self._sb = sb

    async def upload_file(self, file: bytes, remote_path: str, timeout: int = 1800) -> None:
        self._sb._cloud.maybe_fail("upload")
        self._sb._check()
        await self._sb.box.write(remote_path, bytes(file))

    async def download_file(self, remote_path: str, timeout: int = 1800) -> bytes:
        self._sb._cloud.maybe_fail("download")
        self._sb._check()
        try:
            return await self._sb.box.read(remote_path)
        except (FileNotFoundError, IsADirectoryError):
            raise DaytonaFileNotFoundError(f"file not found: {remote_path}", status_code=404) from None


class FakeSandbox:
    def __init__(self, cloud: FakeCloud, sandbox_id: str, box, labels: dict[str, str]) -> None:
        self._cloud = cloud
        self.id = sandbox_id
        self.box = box
        self.labels = labels
        self.state = SandboxState.STARTED
        self.process = _Process(self)
        self.fs = _FileSystem(self)
        self._background: list[asyncio.Future] = []

    def _check(self) -> None:
        if self.state != SandboxState.STARTED:
            raise DaytonaNotFoundError(f"Sandbox {self.id} not found", status_code=404)

    async def refresh_data(self, request_timeout: float | None = None) -> None:
        if self.state == SandboxState.DESTROYED:
            raise DaytonaNotFoundError(f"Sandbox {self.id} not found", status_code=404)
        if not await self.box.alive():
            self.state = SandboxState.STOPPED

    async def delete(self, timeout: float | None = 60, wait: bool = False) -> None:
        self._cloud.maybe_fail("delete")
        if self.state == SandboxState.DESTROYED:
            raise DaytonaNotFoundError(f"Sandbox {self.id} not found", status_code=404)
        for task in self._background:
            task.cancel()
        self.state = SandboxState.DESTROYED
        await self.box.kill()

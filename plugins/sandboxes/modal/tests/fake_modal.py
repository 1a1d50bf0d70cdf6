"""A faithful fake of the part of the ``modal`` SDK (1.6.4) the adapter calls.

The real ``modal.Image`` (its constructors are lazy and offline) and Modal's own exception
classes; ``App``/``Sandbox``/``ContainerProcess`` mimic the SDK's async ``.aio`` surface with
Modal's quirks: ``Sandbox.exec(*argv, timeout=)`` returns a process whose ``wait()`` gives
``-1`` when its timeout passes (no exception); ``filesystem.read_bytes`` raises
``SandboxFilesystemNotFoundError``; ``terminate()`` is a no-op on a finished sandbox; exec on a
terminated sandbox raises ``SandboxTerminatedError``. Commands run for real in a
:class:`~miles_engine.testing.remote_fakes.LocalBox`.

Failure injection: ``cloud.fail(op, exc, times=1)`` (ops: lookup, create, create_lost_answer,
exec, exec_after_start, write, read, list, terminate).
"""

from __future__ import annotations

import asyncio
import secrets
import types
from dataclasses import dataclass, field
from typing import Any

import modal
from modal.exception import (
    SandboxFilesystemIsADirectoryError,
    SandboxFilesystemNotFoundError,
    SandboxTerminatedError,
)

from miles_engine.testing.remote_fakes import BoxGone, LocalBoxes


class aio:
    """A method reachable as ``obj.method.aio(...)``, like synchronicity's wrappers."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __get__(self, obj, owner):
        target = self.fn.__get__(obj, owner) if obj is not None else self.fn.__get__(owner, owner)
        return types.SimpleNamespace(aio=target)


@dataclass
class FakeCloud:
    boxes: LocalBoxes = field(default_factory=LocalBoxes)
    apps: dict[str, FakeApp] = field(default_factory=dict)
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

        class App(FakeApp):
            _cloud = cloud

        class Sandbox(FakeSandbox):
            _cloud = cloud

        return types.SimpleNamespace(App=App, Image=modal.Image, Sandbox=Sandbox)

    async def aclose(self) -> None:
        await self.boxes.aclose()


class FakeApp:
    _cloud: FakeCloud

    def __init__(self, name: str) -> None:
        self.name = name
        self.app_id = "ap-" + secrets.token_hex(8)

    @aio
    async def lookup(cls, name: str, *, client=None, environment_name=None, create_if_missing: bool = False):
        cls._cloud.maybe_fail("lookup")
        if name not in cls._cloud.apps:
            if not create_if_missing:
                from modal.exception import NotFoundError

                raise NotFoundError(f"App '{name}' not found")
            cls._cloud.apps[name] = cls(name)
        return cls._cloud.apps[name]


class _Stream:
    def __init__(self, fut: asyncio.Future, index: int) -> None:
        self._fut, self._i = fut, index

    @aio
    async def read(self) -> str:
        raw = await self._fut
        return "" if raw is None else (raw.stdout, raw.stderr)[self._i].decode(errors="replace")


class FakeContainerProcess:
    def __init__(self, fut: asyncio.Future) -> None:
        self._fut = fut
        self.stdout = _Stream(fut, 0)
        self.stderr = _Stream(fut, 1)

    @aio
    async def wait(self) -> int:
        raw = await self._fut
        if raw is None or raw.timed_out:
            return -1
        return raw.exit_code


class _Filesystem:
    def __init__(self, sb: FakeSandbox) -> None:
        self._sb = sb

    @aio
    async def write_bytes(self, data: bytes, remote_path: str) -> None:
        self._sb._cloud.maybe_fail("write")
        self._sb._check()
        await self._sb.box.write(remote_path, bytes(data))

    @aio
    async def read_bytes(self, remote_path: str) -> bytes:
        self._sb._cloud.maybe_fail("read")
        self._sb._check()
        try:
            return await self._sb.box.read(remote_path)
        except FileNotFoundError:
            raise SandboxFilesystemNotFoundError(f"{remote_path}: no such file or directory") from None
        except IsADirectoryError:
            raise SandboxFilesystemIsADirectoryError(f"{remote_path}: is a directory") from None


class FakeSandbox:
    _cloud: FakeCloud

    def __init__(self, box, app, tags: dict[str, str], kwargs: dict[str, Any]) -> None:
        self.object_id = "sb-" + secrets.token_hex(8)
        self.box, self.app, self.tags, self.kwargs = box, app, tags, kwargs
        self.returncode: int | None = None
        self.filesystem = _Filesystem(self)
        self._background: list[asyncio.Future] = []

    @aio
    async def create(cls, *args: str, app=None, name=None, tags=None, image=None, env=None, secrets=None,
                     timeout: int | None = 300, idle_timeout=None, workdir=None, gpu=None, cpu=None, memory=None,
                     block_network: bool = False, outbound_cidr_allowlist=None, outbound_domain_allowlist=None,
                     **rest: Any) -> FakeSandbox:
        cloud = cls._cloud
        if app is None:
            from modal.exception import InvalidError

            raise InvalidError("Sandboxes require an App when created outside of a Modal container")
        if not isinstance(image, modal.Image):
            raise TypeError(f"image must be a modal.Image, got {type(image).__name__}")
        kwargs = {"args": args, "timeout": timeout, "gpu": gpu, "cpu": cpu, "memory": memory, "block_network": block_network,
                  "outbound_cidr_allowlist": outbound_cidr_allowlist, "outbound_domain_allowlist": outbound_domain_allowlist}
        cloud.calls.append(("create", kwargs))
        cloud.maybe_fail("create")
        box = await cloud.boxes.start(network=not block_network)
        sb = cls(box, app, dict(tags or {}), kwargs)
        cloud.sandboxes[sb.object_id] = sb
        cloud.maybe_fail("create_lost_answer")
        return sb

    @aio
    async def list(cls, *, app_id: str | None = None, tags: dict[str, str] | None = None, client=None):
        cloud = cls._cloud
        cloud.maybe_fail("list")
        for sb in list(cloud.sandboxes.values()):  # only running sandboxes are listed
            if sb.returncode is None and (app_id is None or sb.app.app_id == app_id) and \
                    all(sb.tags.get(k) == v for k, v in (tags or {}).items()):
                yield sb

    @aio
    async def get_tags(self) -> dict[str, str]:
        return dict(self.tags)

    @aio
    async def exec(self, *args: str, timeout: int | None = None, workdir: str | None = None,
                   env: dict | None = None, **rest: Any) -> FakeContainerProcess:
        self._cloud.calls.append(("exec", args))
        self._cloud.maybe_fail("exec")
        self._check()
        fut = asyncio.ensure_future(self._run(list(args), workdir, env, timeout))
        drop = self._cloud.faults.get("exec_after_start")
        if drop:
            exc = drop.pop(0)
            self._background.append(fut)
            await asyncio.sleep(0.05)
            raise exc
        return FakeContainerProcess(fut)

    async def _run(self, argv, workdir, env, timeout):
        try:
            return await self.box.run(argv, cwd=workdir, env=env, timeout_s=timeout or 86400)
        except BoxGone:
            return None

    @aio
    async def poll(self) -> int | None:
        if self.returncode is None and not await self.box.alive():
            self.returncode = 137
        return self.returncode

    @aio
    async def terminate(self, *, wait: bool = False) -> None:
        self._cloud.maybe_fail("terminate")
        if self.returncode is None:
            self.returncode = 137
            for task in self._background:
                task.cancel()
            await self.box.kill()

    def _check(self) -> None:
        if self.returncode is not None:
            raise SandboxTerminatedError(f"Sandbox {self.object_id} has already terminated")

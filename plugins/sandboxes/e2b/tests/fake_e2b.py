"""A faithful fake of the part of the ``e2b`` SDK (2.56.0) the adapter calls.

Same call signatures, same return types (the SDK's own ``CommandResult``, ``SandboxInfo``,
``SandboxQuery``, ``BuildInfo``) and the SDK's own exception classes, with E2B's quirks:
``commands.run`` runs ``/bin/bash -l -c CMD`` as the given user, raises
``CommandExitException`` on a non-zero exit and ``TimeoutException`` when its ``timeout``
passes; ``files.write`` creates parent directories; ``files.read`` raises
``FileNotFoundException``; a killed sandbox answers ``SandboxNotRunningException``.
Commands run for real in a :class:`~miles_engine.testing.remote_fakes.LocalBox`.

Failure injection: ``cloud.fail(op, exc, times=1)`` makes the next call(s) of ``op`` raise
``exc`` (ops: create, create_lost_answer, run, run_after_start, write, read, list, kill,
template_build);
``run_after_start`` starts the command and then drops the stream.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from e2b.exceptions import (
    AuthenticationException,
    FileNotFoundException,
    SandboxNotRunningException,
    TimeoutException,
)
from e2b.sandbox.commands.command_handle import CommandExitException, CommandResult
from e2b.sandbox.sandbox_api import SandboxInfo, SandboxQuery
from e2b.template.types import BuildInfo

from miles_engine.testing.remote_fakes import BoxGone, LocalBoxes


@dataclass
class FakeCloud:
    api_key: str = "e2b_test_key_0123456789"
    boxes: LocalBoxes = field(default_factory=LocalBoxes)
    sandboxes: dict[str, FakeAsyncSandbox] = field(default_factory=dict)
    templates: dict[str, dict[str, Any]] = field(default_factory=dict)
    faults: dict[str, list[BaseException]] = field(default_factory=dict)
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def fail(self, op: str, exc: BaseException, times: int = 1) -> None:
        self.faults.setdefault(op, []).extend([exc] * times)

    def maybe_fail(self, op: str) -> None:
        queue = self.faults.get(op)
        if queue:
            raise queue.pop(0)

    def check_key(self, api_key: str | None) -> None:
        if api_key != self.api_key:
            raise AuthenticationException("Invalid API key")

    def sdk(self) -> Any:
        cloud = self

        class AsyncSandbox(FakeAsyncSandbox):
            _cloud = cloud

        class AsyncTemplate(FakeAsyncTemplate):
            _cloud = cloud

        import types

        return types.SimpleNamespace(AsyncSandbox=AsyncSandbox, AsyncTemplate=AsyncTemplate, SandboxQuery=SandboxQuery)

    async def aclose(self) -> None:
        await self.boxes.aclose()


class _KillVariant:
    """E2B's ``kill`` works on the class (``AsyncSandbox.kill(id)``) and on an instance."""

    def __get__(self, obj, owner):
        if obj is None:
            async def cls_kill(sandbox_id: str, **opts: Any) -> bool:
                owner._cloud.check_key(opts.get("api_key"))
                owner._cloud.maybe_fail("kill")
                sb = owner._cloud.sandboxes.get(sandbox_id)
                return await sb._kill() if sb else False

            return cls_kill

        async def inst_kill(**opts: Any) -> bool:
            obj._cloud.maybe_fail("kill")
            return await obj._kill()

        return inst_kill


class _Commands:
    def __init__(self, sb: FakeAsyncSandbox) -> None:
        self._sb = sb

    async def run(self, cmd: str, background: bool | None = None, envs: dict[str, str] | None = None,
                  user: str | None = None, cwd: str | None = None, on_stdout=None, on_stderr=None,
                  stdin: bool | None = None, timeout: float | None = 60,
                  request_timeout: float | None = None) -> CommandResult:
        sb = self._sb
        sb._cloud.calls.append(("run", {"cmd": cmd, "user": user, "timeout": timeout}))
        sb._cloud.maybe_fail("run")
        sb._check_running()
        argv = ["/bin/bash", "-l", "-c", cmd]
        env = {**sb.envs, **(envs or {})}
        limit = timeout if timeout else 3600.0
        drop = sb._cloud.faults.get("run_after_start")
        if drop:
            exc = drop.pop(0)
            sb._background.append(asyncio.ensure_future(sb.box.run(argv, cwd=cwd, env=env, timeout_s=limit)))
            await asyncio.sleep(0.05)  # the command has started when the stream drops
            raise exc
        try:
            raw = await sb.box.run(argv, cwd=cwd, env=env, timeout_s=limit)
        except BoxGone:
            raise SandboxNotRunningException("The sandbox was killed or reached its timeout") from None
        if raw.timed_out:
            raise TimeoutException("context deadline exceeded: the command exceeded its timeout")
        out, err = raw.stdout.decode(errors="replace"), raw.stderr.decode(errors="replace")
        if raw.exit_code != 0:
            raise CommandExitException(stderr=err, stdout=out, exit_code=raw.exit_code, error=f"exit status {raw.exit_code}")
        return CommandResult(stderr=err, stdout=out, exit_code=0, error=None)


class _Files:
    def __init__(self, sb: FakeAsyncSandbox) -> None:
        self._sb = sb

    async def write(self, path: str, data: Any, user: str | None = None, request_timeout: float | None = None,
                    gzip: bool = False, use_octet_stream: bool | None = None, metadata: dict | None = None):
        self._sb._cloud.maybe_fail("write")
        self._sb._check_running()
        payload = data.encode() if isinstance(data, str) else bytes(data)
        await self._sb.box.write(path, payload)  # creates parent directories, like E2B
        return {"path": path}

    async def read(self, path: str, format: str = "text", user: str | None = None,
                   request_timeout: float | None = None, gzip: bool = False, stream_idle_timeout: float | None = None):
        self._sb._cloud.maybe_fail("read")
        self._sb._check_running()
        try:
            data = await self._sb.box.read(path)
        except (FileNotFoundError, IsADirectoryError):
            raise FileNotFoundException(f"path '{path}' does not exist") from None
        return bytearray(data) if format == "bytes" else data.decode()


class FakeAsyncSandbox:
    _cloud: FakeCloud
    kill = _KillVariant()

    def __init__(self, sandbox_id: str, box, metadata: dict[str, str], envs: dict[str, str], template: str) -> None:
        self.sandbox_id = sandbox_id
        self.box = box
        self.metadata = metadata
        self.envs = envs
        self.template = template
        self.started_at = datetime.now(UTC)
        self.commands = _Commands(self)
        self.files = _Files(self)
        self._background: list[asyncio.Future] = []

    @classmethod
    async def create(cls, template: str | None = None, timeout: int | None = None, metadata: dict | None = None,
                     envs: dict | None = None, secure: bool | None = None, allow_internet_access: bool | None = None,
                     mcp=None, network: dict | None = None, iam=None, lifecycle=None, volume_mounts=None, logger=None,
                     **opts: Any) -> FakeAsyncSandbox:
        cloud = cls._cloud
        cloud.calls.append(("create", {"template": template, "timeout": timeout, "metadata": metadata,
                                       "allow_internet_access": allow_internet_access, "network": network}))
        cloud.check_key(opts.get("api_key"))
        cloud.maybe_fail("create")
        template = template or "base"
        if template != "base" and template not in cloud.templates:
            from e2b.exceptions import NotFoundException

            raise NotFoundException(f"template '{template}' not found")
        public = allow_internet_access is not False and not (network or {}).get("deny_out")
        box = await cloud.boxes.start(network=public)
        sb = cls("i" + secrets.token_hex(9), box, dict(metadata or {}), dict(envs or {}), template)
        cloud.sandboxes[sb.sandbox_id] = sb
        # A create that fails *after* the sandbox exists (the answer was lost).
        cloud.maybe_fail("create_lost_answer")
        return sb

    @classmethod
    def list(cls, query: SandboxQuery | None = None, limit: int | None = None, next_token: str | None = None,
             order=None, **opts: Any):
        cloud = cls._cloud
        want = (query.metadata if query else None) or {}
        return _Paginator(cloud, want, opts.get("api_key"))

    async def is_running(self, request_timeout: float | None = None) -> bool:
        return await self.box.alive()

    async def _kill(self) -> bool:
        if self.box.killed:
            return False
        for task in self._background:
            task.cancel()
        await self.box.kill()
        return True

    def _check_running(self) -> None:
        if self.box.killed:
            raise SandboxNotRunningException(f"sandbox {self.sandbox_id} was not found")

    def info(self) -> SandboxInfo:
        return SandboxInfo(
            sandbox_id=self.sandbox_id, sandbox_domain=None, template_id=self.template, name=self.template,
            metadata=self.metadata, started_at=self.started_at, end_at=self.started_at, state="running",
            cpu_count=2, memory_mb=512, envd_version="0.2.0",
        )


class _Paginator:
    """``AsyncSandboxPaginator``: pages of two, ``has_next`` / ``next_items()``."""

    def __init__(self, cloud: FakeCloud, want: dict[str, str], api_key: str | None) -> None:
        self._cloud, self._want, self._key = cloud, want, api_key
        self._items: list[SandboxInfo] | None = None
        self.has_next = True

    async def next_items(self, **opts: Any) -> list[SandboxInfo]:
        if not self.has_next:
            raise Exception("No more items to fetch")  # noqa: TRY002 - what the SDK raises
        self._cloud.check_key(self._key)
        self._cloud.maybe_fail("list")
        if self._items is None:
            self._items = [
                sb.info() for sb in self._cloud.sandboxes.values()
                if not sb.box.killed and all(sb.metadata.get(k) == v for k, v in self._want.items())
            ]
        page, self._items = self._items[:2], self._items[2:]
        self.has_next = bool(self._items)
        return page


class FakeAsyncTemplate:
    _cloud: FakeCloud

    def __init__(self, file_context_path: str | None = None, file_ignore_patterns=None) -> None:
        self.file_context_path = file_context_path
        self.steps: list[tuple[str, Any]] = []

    def from_image(self, image: str, username=None, password=None) -> FakeAsyncTemplate:
        self.steps.append(("from_image", image))
        return self

    def from_dockerfile(self, dockerfile_content_or_path: str) -> FakeAsyncTemplate:
        self.steps.append(("from_dockerfile", dockerfile_content_or_path))
        return self

    def from_base_image(self) -> FakeAsyncTemplate:
        self.steps.append(("from_base_image", None))
        return self

    def set_user(self, user: str) -> FakeAsyncTemplate:
        self.steps.append(("set_user", user))
        return self

    def set_workdir(self, workdir: str) -> FakeAsyncTemplate:
        self.steps.append(("set_workdir", workdir))
        return self

    @classmethod
    async def exists(cls, name: str, **opts: Any) -> bool:
        cls._cloud.check_key(opts.get("api_key"))
        return name in cls._cloud.templates

    @classmethod
    async def build(cls, template: FakeAsyncTemplate, name: str | None = None, *, alias=None, tags=None,
                    cpu_count: int | None = None, memory_mb: int | None = None, min_free_disk_mb=None,
                    skip_cache: bool = False, on_build_logs=None, **opts: Any) -> BuildInfo:
        cls._cloud.check_key(opts.get("api_key"))
        cls._cloud.maybe_fail("template_build")
        cls._cloud.templates[name] = {"steps": template.steps, "context": template.file_context_path,
                                      "cpu_count": cpu_count, "memory_mb": memory_mb}
        return BuildInfo(template_id="t" + secrets.token_hex(6), build_id="b" + secrets.token_hex(6), name=name, alias=name)

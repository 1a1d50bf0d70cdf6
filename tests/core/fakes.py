"""Small in-memory fakes for core tests (the real local sandbox has its own tests)."""

from __future__ import annotations

import asyncio
from typing import Any

from miles_engine.environments.base import SandboxTask
from miles_engine.environments.protocol import EpisodeContext, Message, RewardResult, TaskLimits
from miles_engine.sandbox.protocol import Capabilities, ExecResult, SandboxSpec, check_supported


class MemorySandbox:
    isolation = "process"

    def __init__(self) -> None:
        self.id = "mem"
        self.files: dict[str, bytes] = {}
        self.closed = 0

    async def exec(self, cmd: Any, **_: Any) -> ExecResult:
        if isinstance(cmd, str) and cmd.startswith("write "):
            _, path, content = cmd.split(" ", 2)
            self.files[path] = content.encode()
            return ExecResult(0, "", "")
        if cmd == "sleep":
            await asyncio.sleep(10)
        return ExecResult(0, f"ran {cmd}\n", "")

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self.files[path] = data.encode() if isinstance(data, str) else data

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        return self.files[path]

    async def upload_dir(self, local: Any, remote: str) -> None: ...

    async def download_dir(self, remote: str, local: Any) -> None: ...

    async def alive(self) -> bool:
        return not self.closed

    async def close(self) -> None:
        self.closed += 1

    async def __aenter__(self) -> MemorySandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class MemoryBackend:
    name = "memory"

    def __init__(self) -> None:
        self.created: list[MemorySandbox] = []

    def capabilities(self) -> Capabilities:
        return Capabilities(isolation="process", network_modes=frozenset({"none", "public"}), absolute_paths=True)

    async def create(self, spec: SandboxSpec) -> MemorySandbox:
        check_supported(spec, self.capabilities(), backend=self.name)
        sb = MemorySandbox()
        self.created.append(sb)
        return sb

    async def aclose(self) -> None: ...


class FileTask(SandboxTask):
    """Reward 1 iff /app/answer holds 'yes'. Knobs make each phase misbehave."""

    def __init__(self, task_id: str = "t", *, fail: str | None = None, limits: TaskLimits | None = None,
                 spec: SandboxSpec | None = SandboxSpec()) -> None:
        super().__init__(task_id, limits=limits or TaskLimits(agent_timeout_s=1, verifier_timeout_s=1))
        self.fail = fail
        self.spec = spec

    def prompt(self) -> list[Message]:
        return [{"role": "user", "content": "write yes to /app/answer"}]

    def sandbox_spec(self) -> SandboxSpec | None:
        return self.spec

    async def setup(self, ctx: EpisodeContext) -> None:
        if self.fail == "setup":
            raise RuntimeError("setup exploded")

    async def solve(self, ctx: EpisodeContext) -> None:
        if self.fail == "agent-timeout":
            await ctx.call_tool("bash", {"command": "sleep"})
        await ctx.call_tool("bash", {"command": "write /app/answer yes"})

    async def verify(self, ctx: EpisodeContext) -> RewardResult:
        if self.fail == "verify":
            raise ValueError("garbage reward")
        if self.fail == "verify-timeout":
            await asyncio.sleep(10)
        assert ctx.sandbox is not None
        ok = (await ctx.sandbox.read_file("/app/answer")) == b"yes" if "/app/answer" in ctx.sandbox.files else False
        return RewardResult(reward=1.0 if ok else 0.0)

    async def teardown(self, ctx: EpisodeContext) -> None:
        if self.fail == "teardown":
            raise OSError("teardown failed")

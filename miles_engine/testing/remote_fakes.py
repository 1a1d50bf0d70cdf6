"""Host-side stand-ins for a cloud provider's machines, for testing remote sandbox adapters.

A remote adapter's unit tests replace the provider SDK with a fake that has the SDK's exact
surface (the calls, return types and exceptions the adapter uses). Behind that surface the
fake needs *somewhere* to run the shell the adapter sends; :class:`LocalBox` is that place:
a local namespace sandbox with the usual absolute paths (``/app``, ``/tmp``...), so the
adapter's real scripts run for real and the contract suite means something.

::

    boxes = LocalBoxes()                 # one per test class; await boxes.aclose() at the end
    box = await boxes.start(network=False, env={"A": "1"})
    res = await box.run(["bash", "-c", "echo hi"], timeout_s=5)   # process.RawResult
    await box.kill()

Needs the local backend's namespace tier (bubblewrap or unprivileged user namespaces); use
:func:`namespaces_available` to skip otherwise.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping, Sequence

from miles_engine.errors import SandboxError
from miles_engine.sandbox.local.backend import LocalSandboxBackend
from miles_engine.sandbox.local.options import LocalSandboxOptions
from miles_engine.sandbox.local.probe import probe
from miles_engine.sandbox.local.process import RawResult
from miles_engine.sandbox.local.sandbox import LocalSandbox
from miles_engine.sandbox.protocol import NetworkPolicy, SandboxSpec

BOX_PATHS = ("/app", "/logs", "/tests", "/solution", "/workspace", "/home/user")


class BoxGone(SandboxError):
    """The box was killed; what a provider reports for a deleted sandbox."""


@functools.cache
def namespaces_available() -> bool:
    return probe("auto", 2_000_000, 65_536).isolation == "namespace"


class LocalBox:
    """One fake provider machine (see the module docstring)."""

    def __init__(self, sandbox: LocalSandbox, network: bool) -> None:
        self._sb = sandbox
        self.network = network
        self.killed = False

    @property
    def sandbox_id(self) -> str:
        return self._sb.id

    async def run(
        self,
        argv: Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 600.0,
        max_output: int = 64 << 20,
    ) -> RawResult:
        self._check()
        return await self._sb.run_raw(list(argv), cwd=cwd or "/", env=env, timeout_s=timeout_s, max_output=max_output)

    async def write(self, path: str, data: bytes) -> None:
        self._check()
        await self._sb.write_file(path, data)

    async def read(self, path: str) -> bytes:
        """The file's bytes; :class:`FileNotFoundError` / :class:`IsADirectoryError` as locally."""
        self._check()
        return await self._sb.read_file(path)

    async def alive(self) -> bool:
        return not self.killed and await self._sb.alive()

    async def kill(self) -> None:
        self.killed = True
        await self._sb.close()

    def _check(self) -> None:
        if self.killed:
            raise BoxGone(f"box {self._sb.id} was killed")


class LocalBoxes:
    """Starts :class:`LocalBox` es on one shared local backend."""

    def __init__(self, paths: Sequence[str] = BOX_PATHS) -> None:
        self.paths = tuple(paths)
        self.backend = LocalSandboxBackend(LocalSandboxOptions(isolation="namespace", memory_mb=None))
        self.boxes: list[LocalBox] = []

    async def start(self, *, network: bool = True, env: Mapping[str, str] | None = None) -> LocalBox:
        spec = SandboxSpec(
            paths=self.paths,
            workdir="/",
            env=dict(env or {}),
            network=NetworkPolicy(mode="public" if network else "none"),
            min_isolation="namespace",
        )
        box = LocalBox(await self.backend.create(spec), network)
        self.boxes.append(box)
        return box

    async def aclose(self) -> None:
        await asyncio.gather(*(b.kill() for b in self.boxes if not b.killed), return_exceptions=True)
        await self.backend.aclose()

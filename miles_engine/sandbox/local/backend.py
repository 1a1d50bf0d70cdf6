"""The local sandbox backend: the embedded default, no Docker needed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os

from miles_engine.errors import SandboxError
from miles_engine.sandbox.local import scratch
from miles_engine.sandbox.local.options import LocalSandboxOptions
from miles_engine.sandbox.local.probe import Probe, probe
from miles_engine.sandbox.local.sandbox import LocalSandbox
from miles_engine.sandbox.local.warm import warm_key
from miles_engine.sandbox.protocol import Capabilities, SandboxSpec, check_supported

log = logging.getLogger(__name__)


class LocalSandboxBackend:
    """Sandboxes on this host: Linux namespaces when the kernel allows, else processes.

    The tier is probed once at construction by really starting a sandbox;
    :meth:`capabilities` reports only what was achieved.
    """

    name = "local"

    def __init__(self, options: LocalSandboxOptions | None = None) -> None:
        self.options = options or LocalSandboxOptions()
        o = self.options
        if o.isolation == "process":
            self.probe = Probe("process", None, "process tier requested")
        else:
            found = probe(o.namespace_tool, o.uid_base, o.uid_pool_size)
            if o.isolation == "namespace" and found.isolation != "namespace":
                raise SandboxError(
                    f"local sandbox: isolation='namespace' was asked for but is not available here "
                    f"({found.detail}); install bubblewrap or enable unprivileged user namespaces, "
                    f"or use isolation='auto'/'process'"
                )
            self.probe = found
        self.root = os.geteuid() == 0
        scratch_root, fallback = scratch.resolve_root(o.scratch_root)
        if fallback:
            log.warning("local sandbox: scratch_root 'tmpfs' falls back to %s: %s", scratch_root, fallback)
        self.options = o = o.model_copy(update={"scratch_root": scratch_root})
        if self.root:
            _check_traversable(scratch_root)
        # Scratch dirs of sandboxes whose process died without closing them.
        self._sweep = scratch.purge_executor().submit(scratch.sweep_stale, scratch_root)
        self._live: set[LocalSandbox] = set()
        self._purging: set[concurrent.futures.Future[None]] = set()
        self._warm: dict[tuple[object, ...], list[LocalSandbox]] = {}
        self._closing = False
        self.warm_stats = {"created": 0, "reused": 0, "parked": 0}

    def capabilities(self) -> Capabilities:
        if self.probe.isolation == "namespace":
            return Capabilities(isolation="namespace", network_modes=frozenset({"none", "public"}), absolute_paths=True)
        return Capabilities(isolation="process", network_modes=frozenset({"public"}), absolute_paths=False)

    def describe(self) -> dict[str, object]:
        """What this backend enforces, for ``miles sandbox check`` and logs."""
        return {
            "isolation": self.probe.isolation,
            "detail": self.probe.detail,
            "dedicated_uid": self.root,
            "warm_pool_size": self.options.warm_pool_size if self.probe.tools is not None
            and self.probe.tools.launcher == "bwrap" else 0,
            "max_processes_enforced": (self.root or self.probe.isolation == "namespace")
            and self.options.max_processes is not None,
        }

    async def create(self, spec: SandboxSpec) -> LocalSandbox:
        check_supported(spec, self.capabilities(), backend=self.name)
        idle = self._warm.get(warm_key(spec)) if self.options.warm_pool_size else None
        while idle:
            sb = idle.pop()
            self._live.add(sb)
            if await sb.alive():
                self.warm_stats["reused"] += 1
                await sb.reuse(spec)
                return sb
            await sb.close()  # died while idle (e.g. killed from outside): never reuse, destroy
        sb = LocalSandbox(self, spec)
        self._live.add(sb)
        await sb.start()
        self.warm_stats["created"] += 1
        return sb

    # Warm pool: a closed namespace sandbox is reset in place (processes killed, writable
    # dirs emptied) and kept for the next create() with the same mounts and network, which
    # skips the namespace start (~13 ms of CPU) and teardown.
    def wants_warm(self, sb: LocalSandbox) -> bool:
        key = sb.warm_key
        if key is None or self._closing or not self.options.warm_pool_size:
            return False
        return sum(len(v) for v in self._warm.values()) < self.options.warm_pool_size

    def park(self, sb: LocalSandbox) -> None:
        key = sb.warm_key
        assert key is not None
        self._warm.setdefault(key, []).append(sb)
        self._live.add(sb)
        self.warm_stats["parked"] += 1

    def _forget(self, sb: LocalSandbox) -> None:
        self._live.discard(sb)

    def _purge(self, trash: str) -> None:
        fut = scratch.purge_later(trash)
        self._purging.add(fut)
        fut.add_done_callback(self._purging.discard)

    async def aclose(self) -> None:
        """Close every sandbox this backend still has open (warm ones too) and finish removing
        scratch dirs."""
        self._closing = True
        self._warm.clear()  # every parked sandbox is also in _live
        if self._live:
            await asyncio.gather(*(sb.close() for sb in list(self._live)), return_exceptions=True)
        if self._purging:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in list(self._purging)), return_exceptions=True)


def _check_traversable(path: str) -> None:
    """Sandbox uids must be able to reach their scratch dirs: every existing ancestor of
    ``path`` needs the execute bit for others."""
    cur = os.path.abspath(path)
    while True:
        if os.path.exists(cur) and not os.stat(cur).st_mode & 0o001:
            raise SandboxError(
                f"local sandbox: scratch_root '{path}' is not reachable by the unprivileged sandbox users: "
                f"'{cur}' lacks the execute bit for others (chmod o+x it, or choose another scratch_root)"
            )
        parent = os.path.dirname(cur)
        if parent == cur:
            return
        cur = parent

"""Engine side: keep a local full copy of the canonical bytes, pull the versions the engine
lacks, patch the copy, verify, and only then pause the engine for the load.

Everything before the load (reading the index and shards, decompressing, patching, checking
every patched tensor) runs in a worker thread while the engine keeps generating; the pause
covers only ``update_weights`` of the changed tensors. The engine and the local copy move
together: a refused or failed sync leaves both at the version they held.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from miles_engine.weights.disk_delta import baseline as baseline_mod
from miles_engine.weights.disk_delta import chain, codec
from miles_engine.weights.disk_delta.errors import DiskDeltaError, LineageError, TornVersionError
from miles_engine.weights.disk_delta.layout import INDEX, VersionIndex, read_index, version_dir
from miles_engine.weights.disk_delta.options import DiskDeltaOptions
from miles_engine.weights.disk_delta.retention import drop_lease, write_lease
from miles_engine.engines.protocol import engine_version

log = logging.getLogger(__name__)


@dataclass
class ApplyStats:
    version: int
    versions: int = 0  # deltas applied by this sync (more than one when the engine lagged)
    tensors: int = 0
    wire_bytes: int = 0
    pull_s: float = 0.0
    apply_s: float = 0.0  # decompress + patch + verify (overlaps generation)
    pause_s: float = 0.0  # engine paused: the load only
    sync_s: float = 0.0
    persist_s: float = 0.0  # engine server with a local dir: writing its local copy (after the resume)


class DeltaApplier:
    def __init__(self, engine: Any, root: Path, options: DiskDeltaOptions, *, name: str) -> None:
        self.engine, self.root, self.options, self.name = engine, Path(root), options, name
        self.state: dict[str, np.ndarray] = {}
        self.held: int | None = None
        self.baseline: VersionIndex | None = None
        self.reload = False  # the engine does not serve `state`: the next sync loads every tensor
        self._lock = asyncio.Lock()
        self._zstd = codec.Zstd(options.compression_level)

    async def attach(self) -> None:
        """Materialise version 0 locally (verified) and load it into the engine."""
        import torch

        current = await engine_version(self.engine)
        if current != 0:
            raise LineageError(f"engine {self.name} serves weight version {current}; a disk_delta engine starts "
                               f"from the baseline, version 0")
        self.baseline = read_index(self.root, 0)
        self.state = await asyncio.to_thread(baseline_mod.load, self.root, self.baseline)
        self._dtypes = {n: getattr(torch, e.dtype) for n, e in self.baseline.tensors.items()}
        await self._activate(list(self.state), self.state, 0)
        self.held = 0
        await self._loaded(0)

    async def _wait_complete(self, version: int) -> None:
        """A publisher on another host may still be writing the index: wait a bounded time."""
        deadline = time.monotonic() + self.options.pull_timeout_s
        path = version_dir(self.root, version) / INDEX
        while not path.is_file():
            if time.monotonic() > deadline:
                read_index(self.root, version)  # raises TornVersionError naming the state
                raise TornVersionError(f"weight version {version} has no index after "
                                       f"{self.options.pull_timeout_s:.0f}s")
            await asyncio.sleep(0.05)

    def _prepare(self, held: int, target: int) -> tuple[dict[str, np.ndarray], list[chain.Pulled]]:
        pulled = [chain.pull(self.root, index) for index in chain.resolve(self.root, held, target)]
        overlay, version = chain.patch_versions(self.state, held, pulled, self._zstd)
        if version != target:
            raise LineageError(f"the chain from version {held} ends at {version}, not {target}")
        return overlay, pulled

    async def sync(self, target: int) -> ApplyStats:
        """Bring the engine to ``target``; refused (nothing changes) on any lineage, torn,
        decoding or checksum problem."""
        started = time.perf_counter()
        async with self._lock:
            if self.held is None:
                raise DiskDeltaError(f"engine {self.name}: attach() before sync()")
            stats = ApplyStats(version=target)
            if target == self.held and not self.reload:
                return stats
            current = await engine_version(self.engine)
            if current != self.held and not self.reload:
                raise LineageError(f"engine {self.name} reports weight version {current}, but its disk_delta copy "
                                   f"holds {self.held}: something else changed its weights; refusing to patch")
            overlay: dict[str, np.ndarray] = {}
            if target != self.held:
                await self._wait_complete(target)
                t0 = time.perf_counter()
                overlay, pulled = await asyncio.to_thread(self._prepare, self.held, target)
                stats.pull_s = sum(p.pull_s for p in pulled)
                stats.apply_s = time.perf_counter() - t0 - stats.pull_s
                stats.versions = len(pulled)
                stats.tensors = len(overlay)
                stats.wire_bytes = sum(p.wire_bytes for p in pulled) + sum(
                    (version_dir(self.root, p.index.version) / INDEX).stat().st_size for p in pulled)
            source = {**self.state, **overlay}
            if self.reload:  # a restarted (or otherwise reloaded) engine: load the whole version
                names = list(self.state)
            else:  # a version that changed nothing still moves the version: reload one unchanged tensor
                names = with_sibling_parts(list(overlay) or [next(iter(self.state))], source)
            stats.pause_s = await self._activate(names, source, target)
            self.reload = False
            self.state.update(overlay)
            self.held = target
            await self._loaded(target)
        stats.sync_s = time.perf_counter() - started
        return stats

    async def _loaded(self, version: int) -> None:
        """The engine and the local copy hold ``version``: renew the lease (engine-server
        subclasses also persist the copy here)."""
        write_lease(self.root, self.name, version)

    async def _activate(self, names: list[str], source: dict[str, np.ndarray], version: int) -> float:
        entries = self.baseline.tensors if self.baseline else {}
        tensors = {n: codec.as_tensor(source[n], self._dtypes[n], entries[n].shape) for n in names}
        paused = time.perf_counter()
        await self.engine.pause(self.options.pause_mode)
        try:
            new = await self.engine.update_weights(tensors, version=version)
        finally:
            await self.engine.resume()
        if int(new) != version:
            raise DiskDeltaError(f"engine {self.name} reports version {new} after loading {version}")
        return time.perf_counter() - paused

    def close(self) -> None:
        drop_lease(self.root, self.name)


def with_sibling_parts(names: list[str], source: dict[str, Any]) -> list[str]:
    """``names`` and every other part of a quantised weight one of them is a part of: an engine
    loads a weight's codes and scales together (a delta may change only one of them)."""
    from miles_engine.precision.parts import split_name

    weights = {split[0] for n in names if (split := split_name(n))}
    if not weights:
        return names
    chosen = set(names)
    return names + [n for n in source if n not in chosen and (split := split_name(n)) and split[0] in weights]

"""``disk_delta``: publish each weight version as a verified patch under a shared directory;
engines pull and apply it.

Engines that hold weights in a quantised format (the precision contract's rollout stage) get them
as the quantizer's codes and scales (``W:q.codes``, ``W:q.scales``, quantised here once from the
trainer's values): the baseline, every version and the engines' copies hold the parts, so a push
carries one byte per FP8 code instead of four, and the engine loads exactly the trainer's parts.

Per push: check the tensors against the baseline (names, dtypes, shapes, byte sizes) → write
the version (per-tensor byte diffs against the previous version, zstandard, checksums of the
final bytes, index last) → every engine syncs (pull + patch + verify while generating, then a
short pause for the load; HTTP engine servers do this in their own process, told over HTTP,
see ``apply_on``) → verify every engine's version → garbage-collect old versions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from miles_engine.engines.protocol import served_tensors
from miles_engine.errors import ConfigError
from miles_engine.weights.disk_delta import baseline as baseline_mod
from miles_engine.weights.disk_delta import chain, codec
from miles_engine.weights.disk_delta.applier import DeltaApplier
from miles_engine.weights.disk_delta.errors import DiskDeltaError, LineageError
from miles_engine.weights.disk_delta.layout import INDEX, VersionIndex, discard_after, read_index, scan, version_dir
from miles_engine.weights.disk_delta.options import DiskDeltaOptions
from miles_engine.weights.disk_delta.publisher import DeltaPublisher
from miles_engine.weights.disk_delta.remote import RemoteDeltaSync, pulls_itself
from miles_engine.weights.disk_delta.retention import collect
from miles_engine.weights.protocol import PushStats, engine_name, engines_of, verify_versions

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass
class DiskDeltaStats(PushStats):
    """``bytes`` (``weights/bytes_pushed``) is what crossed the storage: shards + index."""

    changed_bytes: int = 0
    changed_density: float = 0.0  # changed bytes / bytes of every published tensor
    publish_s: float = 0.0
    pull_s: float = 0.0  # slowest engine
    apply_s: float = 0.0  # slowest engine: decompress + patch + verify, overlapping generation
    persist_s: float = 0.0  # slowest engine server writing its local copy (engine_local_dir)
    versions_collected: int = 0


class DiskDeltaTransport:
    name = "disk_delta"

    def __init__(self, engines: Any, **options: Any) -> None:
        self.options = DiskDeltaOptions(**options)
        if not self.options.root:
            raise ConfigError("the disk_delta transport needs a publish root (weights.disk_delta.root)")
        self.root = Path(self.options.root).expanduser()
        self.targets = engines
        if not engines_of(engines):
            raise ValueError("the disk_delta transport needs at least one engine")
        self.baseline: VersionIndex | None = None
        self.publisher: DeltaPublisher | None = None
        # per engine: a DeltaApplier in this process, or a RemoteDeltaSync (the engine server pulls itself)
        self.appliers: dict[int, DeltaApplier | RemoteDeltaSync] = {}
        self._warned_missing = False
        # what the engines hold, where some of it is quantised (pushes then ship codes + scales)
        first = engines_of(engines)[0]
        meta = first.weight_metadata() if hasattr(first, "weight_metadata") else []
        self.held = list(meta) if any(m.format for m in meta) else []

    def _as_held(self, named: Iterable[tuple[str, Any]], where: str) -> Iterable[tuple[str, Any]]:
        if not self.held:
            return named
        from miles_engine.weights.tensors import conform

        return conform(named, self.held, where)

    # ------------------------------------------------------------------ baseline
    def _baseline_tensors(self) -> dict[str, Any]:
        engine = engines_of(self.targets)[0]
        live = served_tensors(engine)
        if live is None:
            raise ConfigError(f"weights.disk_delta.baseline is not set and {engine_name(engine, 0)} "
                              f"({type(engine).__name__}) does not expose its tensors: point baseline at the "
                              f"safetensors checkpoint the engines were started from")
        if not self.held:
            return live
        # the engine's own codes and scales where it can give them; the rest quantised from its values
        exact = engine.held_parts() if hasattr(engine, "held_parts") else {}
        from miles_engine.weights.tensors import weights_of

        given = weights_of(exact)
        rest = [(n, t) for n, t in live.items() if n not in given]
        return {**dict(self._as_held(rest, "disk_delta baseline")), **exact}

    def _open(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        complete, _ = scan(self.root)
        if 0 in complete:
            self.baseline = read_index(self.root, 0)
        elif self.options.baseline and self.held:  # the checkpoint's tensors as the engines hold them
            source = baseline_mod.read_checkpoint(Path(self.options.baseline).expanduser())
            self.baseline = baseline_mod.materialise(self.root, self.options.checksum,
                                                     tensors=dict(self._as_held(source.items(), "disk_delta baseline")))
        elif self.options.baseline:
            self.baseline = baseline_mod.materialise(self.root, self.options.checksum,
                                                     source=Path(self.options.baseline).expanduser())
        else:
            self.baseline = baseline_mod.materialise(self.root, self.options.checksum,
                                                     tensors=self._baseline_tensors())
        state = baseline_mod.load(self.root, self.baseline)
        DeltaPublisher.clean_torn(self.root)
        latest = complete[-1] if complete else 0
        if latest:
            try:
                chain.replay(self.root, state, 0, latest)
            except DiskDeltaError as exc:
                raise DiskDeltaError(f"{self.root} already holds versions up to {latest}, but the trainer cannot "
                                     f"rebuild them from the baseline: {exc}. Use a fresh weights.disk_delta.root"
                                     ) from None
        self.publisher = DeltaPublisher(self.root, self.options, state, latest)
        log.info("disk_delta: publish root %s, baseline of %d tensors (%.1f MB), latest version %d", self.root,
                 self.baseline.total_tensors, self.baseline.total_bytes / 1e6, latest)

    async def _ensure_open(self) -> None:
        if self.publisher is None:
            await asyncio.to_thread(self._open)

    async def rewind(self, version: int) -> list[int]:
        """Discard published versions newer than ``version`` before the first push of a resumed
        run: they belong to the run's abandoned future (published after the checkpoint it resumes
        from), and the resumed run publishes its own ``version + 1, ...`` in their place. An engine
        server that already applied one of them refuses the new lineage and must be restarted."""
        removed = await asyncio.to_thread(discard_after, self.root, version)
        if removed:
            log.warning("disk_delta: resuming at weight version %d, discarded published versions %s", version,
                        removed)
            self.publisher = None  # re-open: replay the chain up to `version`
        return removed

    async def preflight(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Check what the trainer exports against the baseline (call before training)."""
        await self._ensure_open()
        await asyncio.to_thread(lambda: baseline_mod.check_exported(
            self._as_held(named_tensors, "disk_delta preflight"), self.baseline))

    async def _appliers(self, engines: list[Any]) -> list[DeltaApplier | RemoteDeltaSync]:
        fresh = []
        for i, engine in enumerate(engines):
            if id(engine) not in self.appliers:
                name = engine_name(engine, i)
                kind = RemoteDeltaSync if pulls_itself(engine, self.options, name) else DeltaApplier
                applier = kind(engine, self.root, self.options, name=name)
                self.appliers[id(engine)] = applier
                fresh.append(applier)
        try:
            await asyncio.gather(*(a.attach() for a in fresh))
        except BaseException:
            for a in fresh:
                self.appliers.pop(id(a.engine), None)
            raise
        return [self.appliers[id(e)] for e in engines]

    # ------------------------------------------------------------------ push
    def _publish(self, version: int, named: list[tuple[str, Any]], stats: DiskDeltaStats) -> None:
        assert self.publisher is not None and self.baseline is not None
        pub = self.publisher
        if version == pub.version:
            # the same version again (a skipped optimizer step, or version 0 = the baseline itself)
            differ = [n for n, t in named if not np.array_equal(pub.state[n], codec.canonical(t))]
            if differ:
                raise LineageError(f"weight version {version} is already published, but {len(differ)} tensors "
                                   f"differ from it: {', '.join(differ[:5])}; a new version needs a new number")
            return
        index, part = pub.publish(version, named)
        stats.changed_bytes = part.changed_bytes
        stats.changed_density = part.changed_bytes / part.total_bytes if part.total_bytes else 0.0
        stats.tensors = part.changed_tensors
        stats.buckets = len({e.shard for e in index.tensors.values()})
        stats.bytes = part.wire_bytes + (version_dir(self.root, version) / INDEX).stat().st_size

    async def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> DiskDeltaStats:
        started = time.perf_counter()
        await self._ensure_open()
        assert self.baseline is not None
        named = await asyncio.to_thread(lambda: baseline_mod.check_exported(
            self._as_held(named_tensors, f"disk_delta push of version {version}"), self.baseline))
        if not named:
            raise DiskDeltaError(f"push of version {version} carries no tensors")
        engines = engines_of(self.targets)
        stats = DiskDeltaStats(version=version, engines=len(engines))
        stats.missing = len(self.baseline.tensors.keys() - {n for n, _ in named})
        if stats.missing and not self._warned_missing:
            self._warned_missing = True
            log.warning("disk_delta push: %d baseline tensors are not pushed (fine for tied weights)", stats.missing)
        appliers = await self._appliers(engines)
        t0 = time.perf_counter()
        await asyncio.to_thread(self._publish, version, named, stats)
        stats.publish_s = time.perf_counter() - t0
        applied = await asyncio.gather(*(a.sync(version) for a in appliers))
        stats.pause_s = max(a.pause_s for a in applied)
        stats.pull_s = max(a.pull_s for a in applied)
        stats.apply_s = max(a.apply_s for a in applied)
        stats.persist_s = max(a.persist_s for a in applied)
        await verify_versions(engines, version)
        stats.versions_collected = len(await asyncio.to_thread(
            collect, self.root, self.options.retain, self.options.lease_ttl_s))
        stats.push_s = time.perf_counter() - started
        return stats

    async def close(self) -> None:
        for applier in self.appliers.values():
            applier.close()
        self.appliers.clear()

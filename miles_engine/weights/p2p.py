"""``p2p``: the trainer ranks write the weights straight into the rollout engines, point to point.

Broadcast has one sender and every engine receives every tensor. Here every trainer rank is a
source (it gathers a full copy: :mod:`.p2p_source`) and every engine a target that receives
only what its layout declares (its ``weight_metadata``: an engine holding half of a model's
experts declares half):

- **plan** (:func:`plan`): the first ``min(sources, targets)`` targets one to one, the rest spread
  evenly over the sources, so no source serves more than ``ceil(targets / sources)`` engines;
- **one group** of ``sources + targets`` ranks beside every default group (``weights.dist``),
  built at the first push and rebuilt when the fleet changes or a push broke it;
- **per push**: each target's tensors (cast to its dtypes) in buckets of ``bucket_bytes``; the
  sources send round by round through two staging buffers (a round in flight while the next is
  packed); each engine stages its buckets (``miles_p2p_src``, never loaded), and only when every
  engine holds all of its buckets are they committed (``miles_commit_only``). Any failed write
  fails the update naming the tensor and the engine, and no engine activates anything.

The transport drives no bytes itself: the tensors stay on the trainer ranks (:class:`P2PExport`);
a check (``check_update_equal``) has rank 0 compute digests and fetches tensors only to describe a
difference. An RDMA engine (Mooncake, NIXL: both need CUDA libraries) would replace
:func:`miles_engine.weights.dist.send` / ``receive`` under the same plan and staging.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_engine.errors import did_you_mean
from miles_engine.weights import p2p_source
from miles_engine.weights.protocol import PushStats, TransportBase, WeightPushError, engine_name, engines_of, \
    verify_versions
from miles_engine.weights.receiver import FLAT

Spec = tuple[str, str, tuple[int, ...], int]  # name, dtype, shape, bytes


def plan(sources: int, targets: int) -> list[int]:
    """The source of each target: the first ``min(sources, targets)`` one to one, the remaining
    targets spread evenly (round robin) over the sources."""
    if sources < 1 or targets < 1:
        raise ValueError(f"a p2p plan needs sources and targets (got {sources} sources, {targets} targets)")
    return [t % sources for t in range(targets)]


class TrainerSources:
    """The trainer's ranks as p2p sources: ``run(fn, *args)`` runs ``fn(rank trainer, *args)`` on
    every rank (``call``) or, for a one-process trainer, here; rank 0's answer."""

    def __init__(self, trainer: Any, lock: Any = None) -> None:
        self.trainer = trainer
        self.world_size = int(getattr(trainer, "world_size", 1)) if hasattr(trainer, "call") else 1
        self._lock = lock

    async def run(self, fn: Any, *args: Any) -> Any:
        call = getattr(self.trainer, "call", None)

        def work() -> Any:
            if self._lock is None:
                return call(fn, *args) if call is not None else fn(self.trainer, *args)
            with self._lock:
                return call(fn, *args) if call is not None else fn(self.trainer, *args)
        return await asyncio.to_thread(work)


@dataclass
class P2PExport:
    """A push's tensors, staged on every trainer rank under ``version``: the specs only are here."""

    version: int
    specs: list[Spec]
    sources: Any
    replayable: bool = True
    fetched_bytes: int = 0
    _digests: dict[tuple[tuple[str, str], ...], dict[str, str]] = field(default_factory=dict)

    @classmethod
    async def stage(cls, sources: Any, version: int) -> P2PExport:
        specs = await sources.run(p2p_source.stage, version)
        return cls(version, [(n, d, tuple(s), int(b)) for n, d, s, b in specs], sources)

    @property
    def names(self) -> list[str]:
        return [s[0] for s in self.specs]

    @property
    def pushable(self) -> P2PExport:
        return self

    async def digests(self, dtypes: Mapping[str, str]) -> dict[str, str]:
        key = tuple(sorted(dtypes.items()))
        if key not in self._digests:
            self._digests[key] = await self.sources.run(p2p_source.digests, self.version, dict(dtypes))
        return self._digests[key]

    async def fetch(self, names: Sequence[str] | None = None) -> dict[str, Any]:
        got = await self.sources.run(p2p_source.fetch, self.version, None if names is None else list(names))
        self.fetched_bytes += sum(t.numel() * t.element_size() for t in got.values())
        return got


class P2PTransport(TransportBase):
    name = "p2p"
    partial_layouts = True  # an engine receives (and a check reads) only what it declares

    def __init__(self, engines: Any, *, sources: Any, bucket_bytes: int = 64 << 20, backend: str = "auto",
                 master_address: str = "127.0.0.1", timeout_s: float = 120.0, pause_mode: str = "retract") -> None:
        if not engines_of(engines):
            raise ValueError("the p2p transport needs at least one engine")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.targets, self.sources = engines, sources
        self.bucket_bytes, self.backend, self.master_address = bucket_bytes, backend, master_address
        self.timeout_s, self.pause_mode = timeout_s, pause_mode
        self._group: str | None = None
        self._members: list[tuple[int, Any]] = []  # (id, generation) of each engine that joined
        self._epoch: Any = None
        self._store: Any = None
        self.builds = 0
        self.target_bytes: dict[str, int] = {}  # the last push: bytes each engine received
        self.source_bytes: list[int] = []  # the last push: bytes each trainer rank sent

    # ------------------------------------------------------------------ the group
    def _fits(self, engines: list[Any]) -> bool:
        return (self._group is not None and getattr(self.targets, "epoch", None) == self._epoch
                and self._members == [(id(e), getattr(e, "generation", None)) for e in engines])

    async def _ensure_group(self, engines: list[Any]) -> None:
        from miles_engine.weights import dist

        if self._fits(engines):
            return
        await self._teardown(engines)
        sources, world = self.sources.world_size, self.sources.world_size + len(engines)
        backend = dist.resolve_backend(self.backend)
        name = f"miles_p2p_{uuid.uuid4().hex[:8]}"
        self._store = await asyncio.to_thread(dist.master_store, self.master_address, world, self.timeout_s)
        port = self._store.port
        joins = [self.sources.run(p2p_source.join, self.master_address, port, world, name, backend, self.timeout_s)]
        joins += [e.init_weights_update_group(self.master_address, port, sources + i, world, group_name=name,
                                              backend=backend) for i, e in enumerate(engines)]
        results = await asyncio.wait_for(asyncio.gather(*joins, return_exceptions=True), self.timeout_s + 30)
        problems = [str(r) for r in (results[0] if isinstance(results[0], list) else [results[0]]) if r is not None]
        problems += [f"{engine_name(e, i)}: {type(r).__name__}: {r}" for i, (e, r) in enumerate(zip(engines, results[1:]))
                     if isinstance(r, BaseException)]
        self._group = name
        if problems:
            await self._teardown(engines)
            raise WeightPushError("building the p2p weight-sync group failed: " + "; ".join(problems))
        self._members = [(id(e), getattr(e, "generation", None)) for e in engines]
        self._epoch = getattr(self.targets, "epoch", None)
        self.builds += 1

    async def _teardown(self, engines: list[Any]) -> None:
        name, self._group, self._members = self._group, None, []
        if name is None:
            return
        await asyncio.gather(*(e.destroy_weights_update_group(name) for e in engines), return_exceptions=True)
        await self.sources.run(p2p_source.leave, name)
        self._store = None

    # ------------------------------------------------------------------ a push
    def _layout(self, engine: Any, index: int, specs: Mapping[str, Spec]) -> list[tuple[str, str, tuple[int, ...], int]]:
        """What ``engine`` declares of the export, in its dtypes (floating point is cast)."""
        from miles_engine.weights.tensors import nbytes, parse_dtype

        meta = engine.weight_metadata()
        if not meta:
            return list(specs.values())
        out = []
        for m in meta:
            spec = specs.get(m.name)
            if spec is None:
                continue  # tied aliases and what the trainer does not train are not pushed
            name, dtype, shape, _ = spec
            where = f"p2p push to {engine_name(engine, index)}"
            if m.format:
                raise WeightPushError(f"{where}: {name!r} is held in {m.format}; p2p ships full-precision tensors "
                                      f"(quantised engines take weights.transport=broadcast or disk_delta)")
            if tuple(shape) != tuple(m.shape):
                raise WeightPushError(f"{where}: {name!r} has shape {tuple(shape)}, the engine's is {tuple(m.shape)}")
            mine, theirs = parse_dtype(dtype), parse_dtype(m.dtype)
            if mine != theirs and not (mine.is_floating_point and theirs.is_floating_point):
                raise WeightPushError(f"{where}: {name!r} is {dtype}, the engine's is {m.dtype}")
            out.append((name, m.dtype, tuple(shape), nbytes(theirs, shape)))
        return out

    def _buckets(self, layout: list[tuple[str, str, tuple[int, ...], int]]) -> list[list[tuple[str, str, tuple[int, ...], int]]]:
        buckets: list[list[Any]] = [[]]
        size = 0
        for spec in layout:
            if buckets[-1] and size + spec[3] > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(spec)
            size += spec[3]
        return [b for b in buckets if b]

    async def _receive(self, engine: Any, index: int, src: int, buckets: list[list[Any]], version: int,
                       push_id: str) -> None:
        for bucket in buckets:
            try:
                await asyncio.wait_for(engine.update_weights_from_distributed(
                    [s[0] for s in bucket], [s[1] for s in bucket], [list(s[2]) for s in bucket], group_name=self._group,
                    weight_version=version, load_format=FLAT, commit=False, push_id=push_id, p2p_src=src),
                    self.timeout_s + 30)
            except Exception as exc:
                raise WeightPushError(f"p2p write of {bucket[0][0]!r} ({len(bucket)} tensors) from trainer rank {src} "
                                      f"to {engine_name(engine, index)} failed: {type(exc).__name__}: {exc}") from exc

    async def push(self, named_tensors: Any, version: int) -> PushStats:
        if not isinstance(named_tensors, P2PExport):
            raise WeightPushError(f"the p2p transport pushes what the trainer ranks staged (a P2PExport from "
                                  f"TrainerAccess.export_for_push), not {type(named_tensors).__name__}")
        export, started = named_tensors, time.perf_counter()
        engines = engines_of(self.targets)
        specs = {s[0]: s for s in export.specs}
        layouts = [self._layout(e, i, specs) for i, e in enumerate(engines)]
        undeclared = sorted(set(specs) - {s[0] for layout in layouts for s in layout})
        if undeclared:
            raise WeightPushError(f"p2p push: no engine declares {undeclared[0]!r}{did_you_mean(undeclared[0], specs)}"
                                  f" ({len(undeclared)} tensors in all); nothing of this push was applied")
        await self._ensure_group(engines)
        buckets = [self._buckets(layout) for layout in layouts]
        sources, src_of = self.sources.world_size, plan(self.sources.world_size, len(engines))
        jobs = {r: [(sources + t, [[(s[0], s[1]) for s in b] for b in buckets[t]]) for t in range(len(engines))
                    if src_of[t] == r] for r in range(sources)}
        push_id = uuid.uuid4().hex
        stats = PushStats(version=version, tensors=len(specs), engines=len(engines),
                          buckets=sum(len(b) for b in buckets))
        await asyncio.gather(*(e.pause(self.pause_mode) for e in engines))
        paused = time.perf_counter()
        try:
            await self._transfer(engines, src_of, buckets, export, jobs, push_id, version)
            await asyncio.gather(*(e.commit_staged(group_name=self._group, weight_version=version, push_id=push_id)
                                   for e in engines))
        finally:
            await asyncio.gather(*(e.resume() for e in engines), return_exceptions=True)
        stats.pause_s = time.perf_counter() - paused
        self.target_bytes = {engine_name(e, i): sum(s[3] for b in buckets[i] for s in b) for i, e in enumerate(engines)}
        stats.bytes = sum(self.target_bytes.values())
        stats.driver_bytes = 0
        await verify_versions(engines, version)
        stats.push_s = time.perf_counter() - started
        return stats

    async def _transfer(self, engines: list[Any], src_of: list[int], buckets: list[list[Any]], export: P2PExport,
                        jobs: dict[int, Any], push_id: str, version: int) -> None:
        send = asyncio.ensure_future(self.sources.run(p2p_source.send, self._group, export.version, jobs))
        receives = [self._receive(e, i, src_of[i], buckets[i], version, push_id) for i, e in enumerate(engines)]
        results = await asyncio.gather(send, *receives, return_exceptions=True)
        sent, failed = results[0], [r for r in results[1:] if isinstance(r, BaseException)]
        if isinstance(sent, BaseException):
            failed.insert(0, WeightPushError(f"p2p send on the trainer ranks failed: {type(sent).__name__}: {sent}"))
        else:
            self.source_bytes = [int(r["bytes"]) for r in sent]
            for r in sent:
                if r["error"] is not None:
                    e = r["error"]
                    target = engine_name(engines[e["target"] - self.sources.world_size], 0) if e["target"] is not None \
                        else "its targets"
                    failed.append(WeightPushError(f"p2p write of {e['tensor']!r} from trainer rank {r['rank']} to "
                                                  f"{target} failed: {e['why']}"))
        if failed:
            await self._teardown(engines)  # a broken group: the next push builds a new one
            first = failed[0]
            more = f" (and {len(failed) - 1} more failures)" if len(failed) > 1 else ""
            raise WeightPushError(f"{first}{more}; no engine activated any of this push (they keep version "
                                  f"{[getattr(e, 'weight_version', '?') for e in engines]})") from first

    async def close(self) -> None:
        await self._teardown(engines_of(self.targets))

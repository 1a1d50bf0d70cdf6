"""``broadcast``: trainer rank 0 broadcasts weights over a torch.distributed group to engine
processes (our HTTP server, or SGLang), bucket by bucket.

Per push: pause every engine → for each bucket (up to ``bucket_bytes``): send the bucket's
names / dtypes / shapes over HTTP (``/update_weights_from_distributed``, SGLang's request) and
broadcast its bytes → resume → verify every engine's version. The group (gloo on CPU, NCCL on
GPU; TCP rendezvous, by default on 127.0.0.1) is built on the first push: rank 0 here, engine i
is rank i + 1 (``/init_weights_update_group``).

Against our servers a bucket is one flat ``uint8`` broadcast (``load_format="miles_flat"``) and
every bucket but the last is staged (``miles_commit=false``), so an engine applies a push all
at once; against real SGLang it is one broadcast per tensor, loaded bucket by bucket. Tensors
are streamed: at most two buckets are materialised at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from miles_engine.weights.protocol import PushStats, WeightPushError, engine_name, engines_of, verify_versions, TransportBase

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class BroadcastTransport(TransportBase):
    name = "broadcast"

    def __init__(self, engines: Any, *, bucket_bytes: int = 256 << 20, backend: str = "auto",
                 master_address: str = "127.0.0.1", group_name: str = "miles_weight_sync",
                 timeout_s: float = 600.0, pause_mode: str = "retract", flatten: bool | None = None) -> None:
        self.targets = engines
        if not engines_of(engines):
            raise ValueError("the broadcast transport needs at least one engine")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self.master_address = master_address
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.pause_mode = pause_mode
        self.flatten = flatten
        self._group: Any = None
        self._store: Any = None
        self._engines: list[Any] = []
        self._broken: str | None = None
        self.refusal_grace_s = 5.0

    # ------------------------------------------------------------------ group
    async def _ensure_group(self) -> list[Any]:
        from miles_engine.weights import dist

        engines = engines_of(self.targets)
        if self._group is not None:
            if [id(e) for e in engines] != [id(e) for e in self._engines]:
                raise WeightPushError("the engines changed since the weight-sync group was built "
                                      f"({len(self._engines)} -> {len(engines)}); rebuild the transport")
            return engines
        for i, e in enumerate(engines):
            if not hasattr(e, "init_weights_update_group"):
                raise WeightPushError(f"{engine_name(e, i)} ({type(e).__name__}) cannot join a weight-sync group; "
                                      f"the broadcast transport needs HTTP engines (use 'colocated' in-process)")
        self.backend = dist.resolve_backend(self.backend)
        world = len(engines) + 1
        self._store = await asyncio.to_thread(dist.master_store, self.master_address, world, self.timeout_s)
        port = self._store.port
        group = dist.in_daemon_thread(
            dist.new_group, self.backend, master_address=self.master_address, master_port=port, rank=0,
            world_size=world, group_name=self.group_name, timeout_s=self.timeout_s, store=self._store)
        joins = [asyncio.ensure_future(e.init_weights_update_group(self.master_address, port, i + 1, world,
                                                                   group_name=self.group_name, backend=self.backend))
                 for i, e in enumerate(engines)]
        await self._await_with(group, joins, "joining the weight-sync group")
        self._group, self._engines = group.result(), engines
        if self.flatten is None:
            self.flatten = all(getattr(e, "is_miles_server", False) for e in engines)
        log.info("weight-sync group %s: %d engines, %s, port %d", self.group_name, len(engines), self.backend, port)
        return engines

    async def _await_with(self, local: asyncio.Future[Any], remote: list[asyncio.Future[Any]], what: str,
                          grace_s: float = 0.0) -> None:
        """Wait for the local collective and the engines' requests; an engine's refusal fails
        fast (the local side is then stuck until the group timeout: the transport is broken)."""
        pending = {local, *remote}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if not failed:
                continue
            fut = failed[0]
            idx = remote.index(fut) if fut in remote else -1
            who = "this process" if idx < 0 else engine_name(self._engines_or(idx), idx)
            msg = f"{what} failed on {who}: {fut.exception()}"
            if idx >= 0 and not local.done() and grace_s:  # an engine drains a bucket before refusing it
                await asyncio.wait({local}, timeout=grace_s)
            if idx < 0 or not local.done() or local.exception() is not None:
                self._broken = msg
                msg += "; the weight-sync group is unusable, restart the run"
            for other in remote:
                if not other.done():
                    other.cancel()
            raise WeightPushError(msg)

    def _engines_or(self, idx: int) -> Any:
        engines = self._engines or engines_of(self.targets)
        return engines[idx]

    # ------------------------------------------------------------------ push
    def _buckets(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, t in named:
            n = t.numel() * t.element_size()
            if bucket and size + n > self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, t))
            size += n
        if bucket:
            yield bucket

    async def _send(self, engines: list[Any], bucket: list[tuple[str, torch.Tensor]], version: int,
                    last: bool, push_id: str | None = None) -> None:
        from miles_engine.weights import dist, tensors

        device = dist.comm_device(self.backend)
        names = [n for n, _ in bucket]
        dtypes = [tensors.dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        if self.flatten:
            flat = tensors.pack([t for _, t in bucket], device)

            def work() -> None:
                dist.broadcast(self._group, flat)
        else:
            moved = [t.to(device).contiguous() for _, t in bucket]

            def work() -> None:
                for t in moved:
                    dist.broadcast(self._group, t)
        # staged (flat) buckets carry the version as their staging key; SGLang-style buckets load at
        # once, so only the last one moves the version (a push that fails midway never claims it)
        remote = [asyncio.ensure_future(e.update_weights_from_distributed(
            names, dtypes, shapes, group_name=self.group_name,
            weight_version=version if (self.flatten or last) else None,
            load_format="miles_flat" if self.flatten else None, commit=last if self.flatten else None,
            push_id=push_id if self.flatten else None))
            for e in engines]
        await self._await_with(dist.in_daemon_thread(work), remote, "a weight bucket broadcast",
                               grace_s=self.refusal_grace_s)

    async def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PushStats:
        from miles_engine.weights.tensors import conform

        if self._broken:
            raise WeightPushError(f"the weight-sync group is unusable: {self._broken}")
        started = time.perf_counter()
        engines = await self._ensure_group()
        meta = engines[0].weight_metadata()
        stats = PushStats(version=version, engines=len(engines))
        pushed: set[str] = set()
        paused = time.perf_counter()
        await asyncio.gather(*(e.pause(self.pause_mode) for e in engines))
        sent = 0
        push_id = uuid.uuid4().hex
        try:
            ready: list[tuple[str, torch.Tensor]] | None = None
            for bucket in self._buckets(conform(named_tensors, meta, "broadcast push")):
                if ready is not None:
                    await self._send(engines, ready, version, last=False, push_id=push_id)
                    sent += 1
                ready = bucket
                stats.buckets += 1
                stats.tensors += len(bucket)
                stats.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
                pushed.update(n for n, _ in bucket)
            if ready is None:
                raise WeightPushError(f"push of version {version} carries no tensors")
            await self._send(engines, ready, version, last=True, push_id=push_id)
        except Exception as exc:
            if sent and not self.flatten:
                raise WeightPushError(f"{exc} — after {sent} buckets were loaded: the engines now hold a mix of "
                                      f"old and new weights under their old version; push again before "
                                      f"sampling") from exc
            raise
        finally:
            await asyncio.gather(*(e.resume() for e in engines), return_exceptions=True)
            stats.pause_s = time.perf_counter() - paused
        stats.missing = len({m.name for m in meta} - pushed)
        await verify_versions(engines, version)
        stats.push_s = time.perf_counter() - started
        return stats

    async def close(self) -> None:
        if self._group is not None and not self._broken:
            await asyncio.gather(*(e.destroy_weights_update_group(self.group_name) for e in self._engines),
                                 return_exceptions=True)
        self._group = self._store = None
        self._engines = []

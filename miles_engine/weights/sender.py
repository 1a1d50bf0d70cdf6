"""Who is rank 0 of the broadcast transport's group: the seam between the control plane (the
driver: pause, per-bucket metadata over HTTP, resume, verify, rebuilds) and the bytes.

- :class:`LocalSender`: this process (the driver) hosts the store, joins as rank 0 and
  broadcasts tensors it holds (the trainer's export crossed to it).
- :class:`~miles_engine.cluster.weight_sender.Rank0Sender`: trainer rank 0's Ray actor does
  all that with its own export; only bucket specs cross to the driver.

A sender yields :class:`Bucket` s (names / dtypes / shapes / bytes, and what it needs to
broadcast one) and returns an awaitable per broadcast, so the transport waits on it beside the
engines' requests with one bounded wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Bucket:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    nbytes: int
    payload: Any  # LocalSender: the tensors; Rank0Sender: the bucket's index in rank 0's plan


class LocalSender:
    held_by_driver = True  # the pushed bytes pass through this process
    where = "this process"

    def __init__(self, master_address: str = "127.0.0.1") -> None:
        self.master_address = master_address
        self.backend = "gloo"
        self._group: Any = None
        self._store: Any = None

    async def open(self, world: int, group_name: str, backend: str, timeout_s: float
                   ) -> tuple[str, int, str, asyncio.Future[Any]]:
        """Store + rank 0's join (a future done once every engine joined); (address, port, backend, join)."""
        from miles_engine.weights import dist

        self.backend = dist.resolve_backend(backend)
        self._store = await asyncio.to_thread(dist.master_store, self.master_address, world, timeout_s)
        port = self._store.port
        joining = dist.in_daemon_thread(
            dist.new_group, self.backend, master_address=self.master_address, master_port=port, rank=0,
            world_size=world, group_name=group_name, timeout_s=timeout_s, store=self._store)

        def keep(f: asyncio.Future[Any]) -> None:
            if not f.cancelled() and f.exception() is None:
                self._group = f.result()

        joining.add_done_callback(keep)
        return self.master_address, port, self.backend, joining

    async def buckets(self, named: Iterable[tuple[str, Any]], meta: Sequence[Any], bucket_bytes: int
                      ) -> AsyncIterator[Bucket]:
        """Streamed: the transport holds at most two buckets' tensors at a time."""
        from miles_engine.weights.tensors import conform, dtype_name

        bucket: list[tuple[str, Any]] = []
        size = 0

        def made() -> Bucket:
            return Bucket([n for n, _ in bucket], [dtype_name(t.dtype) for _, t in bucket],
                          [list(t.shape) for _, t in bucket], size, [t for _, t in bucket])

        for name, t in conform(named, meta, "broadcast push"):
            n = t.numel() * t.element_size()
            if bucket and size + n > bucket_bytes:
                yield made()
                bucket, size = [], 0
            bucket.append((name, t))
            size += n
        if bucket:
            yield made()

    def broadcast(self, bucket: Bucket, flatten: bool, timeout_s: float = 0.0) -> asyncio.Future[Any]:
        """``timeout_s``: the group's own (set at its creation) bounds it here."""
        from miles_engine.weights import dist, tensors

        device, group = dist.comm_device(self.backend), self._group
        if flatten:
            flat = tensors.pack(bucket.payload, device)

            def work() -> None:
                dist.broadcast(group, flat)
        else:
            moved = [t.to(device).contiguous() for t in bucket.payload]

            def work() -> None:
                for t in moved:
                    dist.broadcast(group, t)
        return dist.in_daemon_thread(work)

    async def abort(self) -> None:
        from miles_engine.weights import dist

        dist.abort_group(self._group)
        self._group = self._store = None

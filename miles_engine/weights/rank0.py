"""The weight-sync group's rank 0 inside trainer rank 0 (its Ray actor): the trainer's export
stays in that process and is broadcast from there; the driver only steers (see
:mod:`miles_engine.cluster.weight_sender`).

- :class:`ExportStash`: rank 0's copies of its exports, by weight version: the one being pushed
  and the last one pushed (what a restarted engine is loaded with; the driver names it).
- :class:`Rank0WeightSync`: the rendezvous store (on the node's address, a free port), rank 0 of
  the group, the bucket plan and the bucket broadcasts. Every blocking wait is bounded and
  returns at once on :meth:`~Rank0WeightSync.abort` (called from another thread of the actor
  while a broadcast waits); the collective itself runs in a daemon thread, like the driver's.
"""

from __future__ import annotations

import concurrent.futures
import io
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from miles_engine.weights.protocol import WeightPushError

Spec = tuple[str, str, tuple[int, ...], int]  # name, dtype, shape, bytes


class ExportStash:
    """Rank 0's exports by version: the one being pushed and the last one pushed (``keep``)."""

    def __init__(self) -> None:
        self._exports: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def stage(self, version: int, tensors: Mapping[str, Any], keep: int | None = None) -> list[Spec]:
        """Keep a copy of ``tensors`` (they may share storage with the live weights) under
        ``version``; of the older ones only ``keep`` (the last pushed: a restarted engine's)."""
        from miles_engine.weights.tensors import dtype_name

        with self._lock:
            self._exports = {v: e for v, e in self._exports.items() if v == keep}
        copies = {n: t.detach().clone() for n, t in tensors.items()}
        with self._lock:
            self._exports[int(version)] = copies
        return [(n, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for n, t in copies.items()]

    def get(self, version: int) -> dict[str, Any]:
        with self._lock:
            if version not in self._exports:
                raise WeightPushError(f"trainer rank 0 holds no export of weight version {version} "
                                      f"(it holds {sorted(self._exports)})")
            return self._exports[version]


def _in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
    """A blocking collective in a daemon thread: one stuck on a dead peer never holds up the actor."""
    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def target() -> None:
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            fut.set_exception(exc)

    threading.Thread(target=target, name="miles-weight-sync-rank0", daemon=True).start()
    return fut


class Rank0WeightSync:
    def __init__(self, stash: ExportStash, host: str) -> None:
        self.stash, self.host = stash, host
        self.backend = "gloo"
        self._group: Any = None
        self._joining: concurrent.futures.Future[Any] | None = None
        self._aborted = threading.Event()
        self._plan: list[list[tuple[str, Any]]] = []
        self._digests: dict[tuple[int, tuple[tuple[str, str], ...]], dict[str, str]] = {}

    # ------------------------------------------------------------------ group
    def open(self, world: int, group_name: str, backend: str, timeout_s: float) -> tuple[str, int, str]:
        """A new store on a free port of this node and rank 0's side of the group (joining in a
        thread: :meth:`wait_open` waits for the engines). Returns (address, port, backend)."""
        from miles_engine.weights import dist

        self.abort()
        self._aborted = threading.Event()
        self.backend = dist.resolve_backend(backend)
        store = dist.master_store(self.host, world, timeout_s)
        self._joining = _in_thread(dist.new_group, self.backend, master_address=self.host, master_port=store.port,
                                   rank=0, world_size=world, group_name=group_name, timeout_s=timeout_s, store=store)
        return self.host, store.port, self.backend

    def wait_open(self, timeout_s: float) -> None:
        if self._joining is None:
            raise WeightPushError("trainer rank 0 opened no weight-sync group")
        self._group = self._wait(self._joining, timeout_s, "joining the weight-sync group")

    def _wait(self, fut: concurrent.futures.Future[Any], timeout_s: float, what: str) -> Any:
        aborted = self._aborted  # open() replaces it: a stale wait still sees its own abort
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return fut.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                if aborted.is_set():
                    raise WeightPushError(f"{what} on trainer rank 0 was aborted") from None
                if time.monotonic() > deadline:
                    raise WeightPushError(f"{what} on trainer rank 0 timed out after {timeout_s:g}s") from None

    def abort(self) -> None:
        """Stop waiting (a broadcast in another thread returns at once) and drop the group."""
        from miles_engine.weights import dist

        self._aborted.set()
        dist.abort_group(self._group)
        self._group = self._joining = None
        self._plan = []

    # ------------------------------------------------------------------ push
    def plan(self, version: int, meta: Sequence[Any], bucket_bytes: int) -> list[list[Spec]]:
        """Conform the export of ``version`` to the engines' metadata and cut it into buckets."""
        from miles_engine.weights.tensors import conform, dtype_name

        tensors = list(conform(self.stash.get(version).items(), meta, "broadcast push"))
        buckets: list[list[tuple[str, Any]]] = []
        size = 0
        for name, t in tensors:
            n = t.numel() * t.element_size()
            if not buckets or (buckets[-1] and size + n > bucket_bytes):
                buckets.append([])
                size = 0
            buckets[-1].append((name, t))
            size += n
        self._plan = buckets
        return [[(n, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for n, t in b]
                for b in buckets]

    def broadcast(self, index: int, flatten: bool, timeout_s: float) -> int:
        from miles_engine.weights import dist, tensors

        group = self._group
        if group is None or index >= len(self._plan):
            raise WeightPushError("trainer rank 0 has no weight-sync group or bucket plan (aborted or never joined)")
        bucket = self._plan[index]
        device = dist.comm_device(self.backend)

        def work() -> None:
            if flatten:
                dist.broadcast(group, tensors.pack([t for _, t in bucket], device))
            else:
                for _, t in bucket:
                    dist.broadcast(group, t.to(device).contiguous())

        self._wait(_in_thread(work), timeout_s, "a weight bucket broadcast")
        return sum(t.numel() * t.element_size() for _, t in bucket)

    # ------------------------------------------------------------------ check / restore
    def digests(self, version: int, dtypes: Mapping[str, str]) -> dict[str, str]:
        """Per-tensor digests of the export as the engines must hold it (floating point cast to
        the engine's dtype in ``dtypes``): what check_update_equal compares with the engines'."""
        from miles_engine.weights.check.compare import as_held
        from miles_engine.weights.tensors import digest

        key = (version, tuple(sorted(dtypes.items())))
        if key not in self._digests:
            export = self.stash.get(version)
            self._digests = {key: {n: digest(as_held(t, dtypes[n], n) if n in dtypes else t) for n, t in export.items()}}
        return self._digests[key]

    def fetch(self, version: int, names: Sequence[str] | None = None) -> bytes:
        """The export's tensors (all, or ``names``) as ``torch.save`` bytes: only for a restarted
        engine, or the check's diagnosis of tensors that differ."""
        import torch

        export = self.stash.get(version)
        buf = io.BytesIO()
        torch.save({n: export[n] for n in (names if names is not None else export) if n in export}, buf)
        return buf.getvalue()

"""Engine side of the ``broadcast`` transport: join the trainer's group, receive buckets, load.

Request fields follow SGLang's ``InitWeightsUpdateGroupReqInput`` (master_address,
master_port, rank_offset, world_size, group_name, backend) and
``UpdateWeightsFromDistributedReqInput`` (names, dtypes, shapes, group_name, flush_cache,
abort_all_requests, weight_version, load_format). This process is one rank: ``rank_offset``.

Two wire layouts: ``load_format=None`` (SGLang's): one broadcast per tensor, in order;
``load_format="miles_flat"``: one ``uint8`` broadcast per bucket, tensors at 64-byte aligned
offsets. Ours also takes ``miles_commit`` (default true): ``false`` stages the bucket and
changes nothing; the committing bucket then loads every staged tensor in one
``engine.update_weights`` call, so an engine never serves half of a push. ``miles_push_id``
names the push: staged buckets of an unfinished earlier push are discarded, never mixed in.
``miles_p2p_src`` (the ``p2p`` transport): the flat bucket comes point to point from that rank
of the group, not by broadcast; ``miles_commit_only`` (no tensors) loads what a push staged. Every bucket is
received in full before it is checked against the engine's metadata (the broadcast must be
drained either way); a bad bucket discards what was staged and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)
FLAT = "miles_flat"


class ReceiveError(ValueError):
    """A distributed weight update was refused; the engine keeps its weights."""


@dataclass
class _Group:
    name: str
    backend: str
    rank: int
    world_size: int
    handle: Any
    # per group: a bucket stuck on a dead peer of an abandoned group never blocks its replacement
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _field(body: dict[str, Any], key: str, kind: type, default: Any = ...) -> Any:
    value = body.get(key, default)
    if value is ...:
        raise ReceiveError(f"{key} is required")
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ReceiveError(f"{key} must be {kind.__name__}, got {value!r}")
    return value


class DistributedReceiver:
    def __init__(self, engine: Any, *, update_lock: asyncio.Lock | None = None, timeout_s: float = 600.0) -> None:
        self.engine = engine
        self.update_lock = update_lock or asyncio.Lock()
        self.timeout_s = timeout_s
        self.groups: dict[str, _Group] = {}
        self._staged: dict[str, Any] = {}
        self._staged_for: tuple[Any, ...] | None = None

    async def init_group(self, body: dict[str, Any]) -> str:
        from miles_engine.weights import dist

        address = _field(body, "master_address", str)
        port = _field(body, "master_port", int)
        rank = _field(body, "rank_offset", int)
        world = _field(body, "world_size", int)
        name = _field(body, "group_name", str, "weight_update_group")
        backend = _field(body, "backend", str, "nccl")
        if name in self.groups:
            raise ReceiveError(f"weight update group {name!r} already exists; destroy it first")
        try:
            backend = dist.resolve_backend(backend)
        except ValueError as exc:
            raise ReceiveError(str(exc)) from None
        handle = await dist.in_daemon_thread(dist.new_group, backend, master_address=address, master_port=port,
                                         rank=rank, world_size=world, group_name=name, timeout_s=self.timeout_s)
        self.groups[name] = _Group(name, backend, rank, world, handle)
        log.info("joined weight update group %s as rank %d of %d (%s)", name, rank, world, backend)
        return f"Succeed to initialize custom process group {name!r} (rank {rank} of {world}, {backend})."

    def destroy_group(self, name: str) -> str:
        from miles_engine.weights import dist

        group = self.groups.pop(name, None)
        if group is None:
            raise ReceiveError(f"no weight update group {name!r}")
        dist.abort_group(group.handle)
        self._staged, self._staged_for = {}, None
        return f"Succeed to destroy custom process group {name!r}."

    def _receive(self, group: _Group, dtypes: list[Any], shapes: list[list[int]], flat: bool,
                 src: int | None = None) -> list[Any]:
        import torch

        from miles_engine.weights import dist, tensors

        device = dist.comm_device(group.backend)
        if flat:
            _, total = tensors.layout(dtypes, shapes)
            buf = torch.empty(total, dtype=torch.uint8, device=device)
            if src is None:
                dist.broadcast(group.handle, buf)
            else:  # p2p: from the one source the transport's plan gave this engine
                dist.receive(group.handle, buf, src)
            out = tensors.unpack(buf, dtypes, shapes)
        else:
            out = [torch.empty(tuple(s), dtype=d, device=device) for d, s in zip(dtypes, shapes)]
            for t in out:
                dist.broadcast(group.handle, t)
        return out  # the engine copies them into its own parameters (across devices if need be)

    async def update(self, body: dict[str, Any]) -> tuple[str, int | None]:
        """Receive one bucket; stage it or load everything staged. Returns (message, new version)."""
        from miles_engine.weights import dist, tensors

        if body.get("miles_commit_only") is True:
            return await self._commit_staged(body)
        names = _field(body, "names", list)
        dtype_names = _field(body, "dtypes", list)
        shapes = _field(body, "shapes", list)
        src = body.get("miles_p2p_src")
        if src is not None and (isinstance(src, bool) or not isinstance(src, int) or src < 0):
            raise ReceiveError(f"miles_p2p_src must be a source rank (an integer >= 0), got {src!r}")
        if src is not None and body.get("load_format") != FLAT:
            raise ReceiveError(f"miles_p2p_src needs load_format {FLAT!r}: a p2p bucket is one flat buffer")
        if not (len(names) == len(dtype_names) == len(shapes)) or not names:
            raise ReceiveError(f"names, dtypes and shapes must be non-empty lists of one length "
                               f"(got {len(names)}, {len(dtype_names)}, {len(shapes)})")
        group = self.groups.get(_field(body, "group_name", str, "weight_update_group"))
        if group is None:
            raise ReceiveError(f"no weight update group {body.get('group_name', 'weight_update_group')!r}; "
                               f"call /init_weights_update_group first (known: {sorted(self.groups)})")
        load_format = body.get("load_format")
        if load_format not in (None, FLAT):
            raise ReceiveError(f"load_format {load_format!r} is not supported (None or {FLAT!r})")
        try:
            dtypes = [tensors.parse_dtype(d) for d in dtype_names]
            shapes = [[int(x) for x in s] for s in shapes]
        except (TypeError, ValueError) as exc:
            raise ReceiveError(f"bad dtypes/shapes: {exc}") from None
        raw_version = body.get("weight_version")
        commit = bool(body.get("miles_commit", True))
        async with group.lock:
            received = await dist.in_daemon_thread(self._receive, group, dtypes, shapes, load_format == FLAT, src)
            key = (group.name, None if raw_version is None else str(raw_version), body.get("miles_push_id"))
            if self._staged_for not in (None, key):
                log.warning("discarding %d staged tensors of an unfinished push %s", len(self._staged),
                            self._staged_for)
                self._staged = {}
            problems = tensors.check_received(
                {n: (d, s) for n, d, s in zip(names, dtype_names, shapes)}, self.engine.weight_metadata())
            if problems:
                self._staged, self._staged_for = {}, None
                raise ReceiveError("weight update refused, nothing was changed: " + "; ".join(problems))
            self._staged.update(zip(names, received))
            if not commit:
                self._staged_for = key
                return f"Staged {len(names)} tensors ({len(self._staged)} in total).", None
            staged, self._staged, self._staged_for = self._staged, {}, None
        version = self.engine.weight_version if raw_version is None else int(str(raw_version))
        async with self.update_lock:
            new = await self.engine.update_weights(staged, version=version)
        return f"Succeeded to update model weights ({len(staged)} tensors). Weight version updated to {new}.", new

    async def _commit_staged(self, body: dict[str, Any]) -> tuple[str, int | None]:
        """``miles_commit_only``: load what the push's buckets staged (the p2p transport commits
        every engine only once every engine has received all of its buckets)."""
        name = _field(body, "group_name", str, "weight_update_group")
        raw_version = body.get("weight_version")
        key = (name, None if raw_version is None else str(raw_version), body.get("miles_push_id"))
        group = self.groups.get(name)
        lock = group.lock if group is not None else asyncio.Lock()
        async with lock:
            if self._staged_for != key or not self._staged:
                self._staged, self._staged_for = {}, None
                raise ReceiveError(f"nothing staged for push {key[2]!r} (version {key[1]}) in group {name!r}: "
                                   f"its buckets never arrived or were discarded")
            staged, self._staged, self._staged_for = self._staged, {}, None
        version = self.engine.weight_version if raw_version is None else int(str(raw_version))
        async with self.update_lock:
            new = await self.engine.update_weights(staged, version=version)
        return f"Succeeded to update model weights ({len(staged)} tensors). Weight version updated to {new}.", new

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

Fleets that change: the group is rebuilt on the next push when an engine process was replaced
(its ``generation`` differs from when it joined: a supervised restart), when the router
quarantined or re-admitted an engine (its ``epoch`` moved: an external server that came back
lost its group), or after a push that broke the group
(an engine died or hung mid-broadcast). The old group is destroyed on the engines still running
it (failures tolerated, bounded by ``control_timeout_s``) and a new one is built under a new
name on a new rendezvous port. Every wait is bounded (``control_timeout_s`` for pause / resume /
destroy, ``timeout_s`` for a join or a bucket): a push never hangs on a dead member, it fails
with one :class:`WeightPushError` naming the engine. A push given a list (not a one-shot
iterator) is retried once on a rebuilt group when an engine process was replaced during it.

Who is rank 0 is the ``sender``'s business (:mod:`.sender`): this process by default
(:class:`LocalSender`, the tensors given to :meth:`push`), or trainer rank 0's Ray actor
(:class:`~miles_engine.cluster.weight_sender.Rank0Sender`, given rank 0's
:class:`~miles_engine.cluster.weight_sender.Rank0Export`: its tensors never come here).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from miles_engine.weights.protocol import PushStats, WeightPushError, engine_name, engines_of, verify_versions, TransportBase
from miles_engine.weights.sender import Bucket, LocalSender

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class BroadcastTransport(TransportBase):
    name = "broadcast"

    def __init__(self, engines: Any, *, bucket_bytes: int = 256 << 20, backend: str = "auto",
                 master_address: str = "127.0.0.1", group_name: str = "miles_weight_sync",
                 timeout_s: float = 600.0, pause_mode: str = "retract", flatten: bool | None = None,
                 control_timeout_s: float = 120.0, sender: Any = None) -> None:
        self.targets = engines
        if not engines_of(engines):
            raise ValueError("the broadcast transport needs at least one engine")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self.sender = sender if sender is not None else LocalSender(master_address)
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self.pause_mode = pause_mode
        self.flatten = flatten
        self._group: Any = None  # rank 0's join (a future), once done
        self._engines: list[Any] = []
        self._generations: list[Any] = []  # each member's process generation when it joined
        self._epoch: Any = None  # the router's admission epoch when the group was built
        self._broken: str | None = None
        self._active_name = group_name
        self.builds = 0  # groups built so far (a rebuild after a restart or a quarantine adds one)
        self.refusal_grace_s = 5.0

    # ------------------------------------------------------------------ group
    @staticmethod
    def _generation(engine: Any) -> Any:
        return getattr(engine, "generation", None)

    def _change(self, engines: list[Any]) -> str | None:
        """Why the group built earlier no longer fits ``engines`` (None: it does)."""
        if self._broken:
            return f"the last push broke it ({self._broken})"
        return self._fleet_change(engines)

    def _fleet_change(self, engines: list[Any]) -> str | None:
        if getattr(self.targets, "epoch", None) != self._epoch:  # an engine left or came back (even the same one)
            return "the router quarantined or re-admitted an engine"
        if [id(e) for e in engines] != [id(e) for e in self._engines]:
            return f"the admitted engines changed ({len(self._engines)} -> {len(engines)})"
        replaced = [engine_name(e, i) for i, (e, g) in enumerate(zip(engines, self._generations))
                    if self._generation(e) != g]
        return f"engine processes were replaced: {', '.join(replaced)}" if replaced else None

    async def _bounded(self, engines: list[Any], call: Any, what: str, *, tolerate: bool = False) -> None:
        """``call(engine)`` on every engine within ``control_timeout_s``; one error naming the failures."""
        async def one(e: Any) -> None:
            await asyncio.wait_for(call(e), self.control_timeout_s)

        results = await asyncio.gather(*(one(e) for e in engines), return_exceptions=True)
        bad = [f"{engine_name(e, i)}: {'timed out' if isinstance(r, TimeoutError) else f'{type(r).__name__}: {r}'}"
               for i, (e, r) in enumerate(zip(engines, results)) if isinstance(r, BaseException)]
        if bad and not tolerate:
            raise WeightPushError(f"{what} failed on " + "; ".join(bad))
        if bad:
            log.warning("%s failed (tolerated) on %s", what, "; ".join(bad))

    async def _teardown(self, reason: str) -> None:
        old, gens, name = self._engines, self._generations, self._active_name
        log.warning("weight-sync group %s: rebuilding, %s", name, reason)
        survivors = [e for e, g in zip(old, gens) if self._generation(e) == g]  # a replaced process lost it
        await self._bounded(survivors, lambda e: e.destroy_weights_update_group(name), "destroying the old "
                            "weight-sync group", tolerate=True)
        await self.sender.abort()
        self._group = None
        self._engines, self._generations, self._broken = [], [], None

    async def _ensure_group(self) -> list[Any]:
        engines = engines_of(self.targets)
        if self._group is not None or self._broken:
            change = self._change(engines)
            if change is None:
                return engines
            await self._teardown(change)
        if not engines:
            raise WeightPushError("no engine to push to: the router has none admitted")
        for i, e in enumerate(engines):
            if not hasattr(e, "init_weights_update_group"):
                raise WeightPushError(f"{engine_name(e, i)} ({type(e).__name__}) cannot join a weight-sync group; "
                                      f"the broadcast transport needs HTTP engines (use 'colocated' in-process)")
        world = len(engines) + 1
        name = self.group_name if not self.builds else f"{self.group_name}-{self.builds}"
        self.builds += 1
        self._active_name, self._engines = name, engines
        self._generations = [self._generation(e) for e in engines]
        self._epoch = getattr(self.targets, "epoch", None)
        address, port, self.backend, group = await self.sender.open(world, name, self.backend, self.timeout_s)
        joins = [asyncio.ensure_future(e.init_weights_update_group(address, port, i + 1, world,
                                                                   group_name=name, backend=self.backend))
                 for i, e in enumerate(engines)]
        try:
            await self._await_with(group, joins, "joining the weight-sync group")
        except WeightPushError:  # the rebuild destroys the group only where it was joined
            joined = [i for i, f in enumerate(joins) if f.done() and not f.cancelled() and f.exception() is None]
            self._engines = [engines[i] for i in joined]
            self._generations = [self._generations[i] for i in joined]
            raise
        self._group = group
        if self.flatten is None:
            self.flatten = all(getattr(e, "takes_flat_buckets", False) for e in engines)
        log.info("weight-sync group %s: %d engines, %s, rank 0 in %s at %s:%d", name, len(engines), self.backend,
                 self.sender.where, address, port)
        return engines

    async def _await_with(self, local: asyncio.Future[Any], remote: list[asyncio.Future[Any]], what: str,
                          grace_s: float = 0.0) -> None:
        """Wait (at most ``timeout_s``) for the local collective and the engines' requests; an
        engine's refusal fails fast. If the local side is left stuck or failed, the group is
        broken: the next push rebuilds it."""
        pending = {local, *remote}
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while pending:
            left = deadline - asyncio.get_running_loop().time()
            done, pending = await asyncio.wait(pending, timeout=max(left, 0), return_when=asyncio.FIRST_EXCEPTION)
            if not done and pending:
                late = [engine_name(self._engines_or(i), i) for i, f in enumerate(remote) if f in pending]
                self._broken = (f"{what} timed out after {self.timeout_s:g}s waiting for "
                                + (", ".join(late) if late else self.sender.where))
                for other in remote:
                    other.cancel()
                raise WeightPushError(self._broken + "; the next push rebuilds the weight-sync group")
            failed = [f for f in done if f.exception() is not None]
            if not failed:
                continue
            fut = failed[0]
            idx = remote.index(fut) if fut in remote else -1
            who = self.sender.where if idx < 0 else engine_name(self._engines_or(idx), idx)
            msg = f"{what} failed on {who}: {fut.exception()}"
            if idx >= 0 and not local.done() and grace_s:  # an engine drains a bucket before refusing it
                await asyncio.wait({local}, timeout=grace_s)
            if idx < 0 or not local.done() or local.exception() is not None:
                self._broken = msg
                msg += "; the weight-sync group is unusable, the next push rebuilds it"
            for other in remote:
                if not other.done():
                    other.cancel()
            raise WeightPushError(msg)

    def _engines_or(self, idx: int) -> Any:
        engines = self._engines or engines_of(self.targets)
        return engines[idx]

    # ------------------------------------------------------------------ push
    async def _send(self, engines: list[Any], bucket: Bucket, version: int, last: bool,
                    push_id: str | None = None) -> None:
        names, dtypes, shapes = bucket.names, bucket.dtypes, bucket.shapes
        local = self.sender.broadcast(bucket, bool(self.flatten), self.timeout_s)
        # staged (flat) buckets carry the version as their staging key; SGLang-style buckets load at
        # once, so only the last one moves the version (a push that fails midway never claims it)
        remote = [asyncio.ensure_future(e.update_weights_from_distributed(
            names, dtypes, shapes, group_name=self._active_name,
            weight_version=version if (self.flatten or last) else None,
            load_format="miles_flat" if self.flatten else None, commit=last if self.flatten else None,
            push_id=push_id if self.flatten else None,
            **({} if g is None else {"generation": g})))  # a replaced process refuses at once
            for e, g in zip(engines, self._generations)]
        await self._await_with(local, remote, "a weight bucket broadcast",
                               grace_s=self.refusal_grace_s)

    async def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PushStats:
        replayable = isinstance(named_tensors, (list, tuple)) or getattr(named_tensors, "replayable", False)

        def fleet() -> list[tuple[int, Any]]:
            return [(getattr(self.targets, "epoch", None), 0),
                    *((id(e), self._generation(e)) for e in engines_of(self.targets))]

        before = fleet()
        try:
            stats = await self._push(named_tensors, version)
            if replayable and await self._replaced_after(before, fleet, version):
                # it took the push, then died: its replacement restored the previous push (not yet recorded)
                log.warning("broadcast push of version %d: an engine process was replaced after it took the push; "
                            "pushing again on a rebuilt group", version)
                return await self._push(named_tensors, version)
            return stats
        except WeightPushError as exc:
            if not replayable:
                raise
            supervised = [e for e in engines_of(self.targets) if self._generation(e) is not None]
            # a supervised engine that lost its process answers once it is back (bounded)
            await self._bounded(supervised, lambda e: e.fetch_weight_version(), "waiting for restarted engines",
                                tolerate=True)
            if fleet() == before:
                raise
            log.warning("broadcast push of version %d failed (%s); the fleet changed, retrying once on a rebuilt "
                        "group", version, exc)
            return await self._push(named_tensors, version)

    async def _replaced_after(self, before: list[tuple[int, Any]], fleet: Any, version: int) -> bool:
        """Whether a supervised engine's process was replaced since the push began, or now serves
        another version (asked of the process, waiting out a restart in progress)."""
        supervised = [e for e in engines_of(self.targets) if self._generation(e) is not None]
        if not supervised:
            return False
        # refreshes each one's weight_version from its live process
        await self._bounded(supervised, lambda e: e.fetch_weight_version(), "asking the engines their version",
                            tolerate=True)
        moved = [(i, g) for i, g in fleet()[1:] if (i, g) not in before[1:]]
        return bool(moved) or any(int(e.weight_version) != version for e in supervised)

    async def _push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PushStats:
        started = time.perf_counter()
        engines = await self._ensure_group()
        meta = engines[0].weight_metadata()
        stats = PushStats(version=version, engines=len(engines), sender_rank0=not self.sender.held_by_driver)
        pushed: set[str] = set()
        paused = time.perf_counter()
        await self._bounded(engines, lambda e: e.pause(self.pause_mode), "pausing the engines")
        sent = 0
        push_id = uuid.uuid4().hex
        try:
            ready: Bucket | None = None
            async for bucket in self.sender.buckets(named_tensors, meta, self.bucket_bytes):
                if ready is not None:
                    await self._send(engines, ready, version, last=False, push_id=push_id)
                    sent += 1
                ready = bucket
                stats.buckets += 1
                stats.tensors += len(bucket.names)
                stats.bytes += bucket.nbytes
                pushed.update(bucket.names)
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
            await self._bounded(engines, lambda e: e.resume(), "resuming the engines", tolerate=True)
            stats.pause_s = time.perf_counter() - paused
        from miles_engine.weights.tensors import weights_of

        stats.missing = len({m.name for m in meta} - weights_of(pushed))
        stats.driver_bytes = stats.bytes if self.sender.held_by_driver else 0
        await verify_versions(engines, version)
        stats.push_s = time.perf_counter() - started
        return stats

    async def close(self) -> None:
        if self._group is not None and not self._broken:
            name = self._active_name
            live = [e for e, g in zip(self._engines, self._generations) if self._generation(e) == g]
            await self._bounded(live, lambda e: e.destroy_weights_update_group(name), "destroying the "
                                "weight-sync group", tolerate=True)
        await self.sender.abort()
        self._group = None
        self._engines, self._generations = [], []

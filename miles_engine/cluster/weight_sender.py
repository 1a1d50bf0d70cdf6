"""Trainer rank 0's Ray actor as rank 0 of the broadcast group (``placement.backend=ray`` with
``weights.transport=broadcast``): the driver keeps the control plane, the actor the bytes.

    export = await trainer.export_for_push()        # Rank0Export: specs only, the tensors stay on rank 0
    stats = await transport.push(export, version)    # BroadcastTransport(sender=Rank0Sender(ranks))

Per push only bucket specs (names / dtypes / shapes / bytes) cross Ray to the driver. The
tensors come to the driver only when a restarted engine needs the last pushed weights
(:meth:`Rank0Export.fetch`) or when check_update_equal diagnoses tensors whose digests differ.
Rank 0's weight calls run in the actor's ``weights`` concurrency group (see ``RankHost``), so
an abort reaches a broadcast stuck on a dead engine; every call is bounded. A rank-0 actor that
died is a :class:`TrainerError` (the run resumes from its checkpoint), not a group to rebuild.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_engine.trainer.distributed import _loads
from miles_engine.trainer.protocol import TrainerError
from miles_engine.weights.protocol import WeightPushError
from miles_engine.weights.sender import Bucket


class Rank0Sender:
    held_by_driver = False
    where = "trainer rank 0"

    def __init__(self, ranks: Any, *, control_timeout_s: float = 120.0) -> None:
        self.ranks = ranks  # RayRanks
        self.control_timeout_s = control_timeout_s
        self.backend = "gloo"
        self.fetched_bytes = 0  # tensors that did cross to the driver (restarts, check diagnoses)

    async def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """One bounded call into rank 0's weight side; its error as a WeightPushError, its death as a TrainerError."""
        ray = self.ranks.cluster.ray
        ref = self.ranks.weight_call(method, *args)
        limit = self.control_timeout_s if timeout_s is None else timeout_s
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), limit)
        except TimeoutError:
            with contextlib.suppress(Exception):  # best effort: rank 0 bounds its own waits
                ray.cancel(ref, force=False)
            raise WeightPushError(f"trainer rank 0 did not answer {method} within {limit:g}s") from None
        except ray.exceptions.RayActorError as exc:
            raise TrainerError(f"trainer rank 0 (Ray actor) died during the weight push ({method}): "
                               f"{str(exc).splitlines()[0]}") from None
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, WeightPushError):
                raise WeightPushError(str(cause)) from None
            raise WeightPushError(f"trainer rank 0 failed during {method}: {exc}") from None

    async def open(self, world: int, group_name: str, backend: str, timeout_s: float
                   ) -> tuple[str, int, str, asyncio.Future[Any]]:
        address, port, self.backend = await self.call("open", world, group_name, backend, timeout_s)
        # its own bound: the transport's wait (timeout_s) decides, this one only frees the actor's thread
        joining = asyncio.ensure_future(self.call("wait_open", timeout_s, timeout_s=timeout_s + self.control_timeout_s))
        return address, port, self.backend, joining

    async def buckets(self, export: Rank0Export, meta: Sequence[Any], bucket_bytes: int) -> AsyncIterator[Bucket]:
        if not isinstance(export, Rank0Export):
            raise WeightPushError(f"the broadcast from trainer rank 0 pushes rank 0's own export, not "
                                  f"{type(export).__name__}: get it from TrainerAccess.export_for_push()")
        plan = await self.call("plan", export.version, list(meta), bucket_bytes)
        for i, specs in enumerate(plan):
            yield Bucket([s[0] for s in specs], [s[1] for s in specs], [list(s[2]) for s in specs],
                         sum(s[3] for s in specs), i)

    def broadcast(self, bucket: Bucket, flatten: bool, timeout_s: float = 600.0) -> asyncio.Future[Any]:
        return asyncio.ensure_future(self.call("broadcast", bucket.payload, flatten, timeout_s,
                                               timeout_s=timeout_s + self.control_timeout_s))

    async def abort(self) -> None:
        await self.call("abort")


@dataclass
class Rank0Export:
    """What the transport pushes under the rank-0 sender: the specs of the export rank 0 keeps."""

    version: int
    specs: list[tuple[str, str, tuple[int, ...], int]]
    sender: Rank0Sender
    replayable: bool = True  # rank 0 keeps it: a push can be sent again on a rebuilt group
    fetched_bytes: int = 0  # tensors of this export that came to the driver (a check's diagnosis)
    _digests: dict[tuple[tuple[str, str], ...], dict[str, str]] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [s[0] for s in self.specs]

    @property
    def pushable(self) -> Rank0Export:  # what a checked transport hands the broadcast transport
        return self

    @property
    def nbytes(self) -> int:
        return sum(s[3] for s in self.specs)

    async def digests(self, dtypes: Mapping[str, str]) -> dict[str, str]:
        key = tuple(sorted(dtypes.items()))
        if key not in self._digests:
            self._digests[key] = await self.sender.call("digests", self.version, dict(dtypes))
        return self._digests[key]

    async def fetch(self, names: Sequence[str] | None = None) -> dict[str, Any]:
        """The tensors themselves, to the driver (a restarted engine; a failed check's diagnosis)."""
        data = await self.sender.call("fetch", self.version, None if names is None else list(names))
        self.fetched_bytes += len(data)
        self.sender.fetched_bytes += len(data)
        return _loads(data)

"""The weight-transport contract: push named tensors to every rollout engine under a version.

A push pauses the engines (so no token is sampled from half-updated weights), moves the
tensors, resumes, then *verifies*: every engine must report exactly the pushed version, read
back from the engine itself (an HTTP engine is asked, not its client's cache). An engine
that missed a push raises :class:`WeightPushError` — its samples would otherwise be labelled
with a version whose weights it does not hold.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from miles_engine.engines.protocol import engine_version
from miles_engine.errors import MilesError

if TYPE_CHECKING:
    import torch


class WeightPushError(MilesError):
    """A weight push failed or an engine does not hold the pushed version."""


@dataclass
class PushStats:
    version: int
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    engines: int = 0
    pause_s: float = 0.0  # engines paused (pause call to resume done)
    push_s: float = 0.0  # the whole push, verification included
    missing: int = 0  # engine tensors this push did not carry (tied weights are fine)
    tensors_checked: int = 0  # (engine, tensor) pairs compared by check_update_equal (0: check off)
    check_s: float = 0.0  # check_update_equal: random fill (first push) + read back + compare
    sender_rank0: bool | None = None  # broadcast: trainer rank 0 sent the bytes (False: this process did)
    driver_bytes: int | None = None  # broadcast: bytes of the pushed tensors that passed through this process

    def metrics(self, prefix: str = "weights") -> dict[str, float]:
        """``weights/version``, ``weights/bytes_pushed``, ``weights/pause_s``, ``weights/push_s``, ...
        (``weights/check_s`` and ``weights/tensors_checked`` only when the push was checked;
        ``weights/sender_rank0`` and ``weights/driver_bytes`` from the broadcast transport)."""
        names = {"bytes": "bytes_pushed"}
        fields = {k: v for k, v in asdict(self).items() if v is not None}
        if not self.tensors_checked:
            fields.pop("tensors_checked")
            fields.pop("check_s")
        return {f"{prefix}/{names.get(k, k)}": float(v) for k, v in fields.items()}


@runtime_checkable
class WeightTransport(Protocol):
    name: str

    async def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PushStats:
        """Send the tensors to every engine; afterwards every engine serves ``version``."""
        ...

    async def close(self) -> None: ...

    async def rewind(self, version: int) -> list[int]:
        """On resume from a checkpoint at ``version``: forget what was pushed after it (disk_delta
        drops the abandoned future). Returns the versions dropped; a no-op elsewhere."""
        ...

    async def preflight(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Before training: refuse tensors the engines could not take (disk_delta checks its
        baseline's names, dtypes and shapes); a no-op elsewhere."""
        ...


class TransportBase:
    """The no-op defaults of a transport's optional abilities (:class:`WeightTransport`)."""

    async def rewind(self, version: int) -> list[int]:
        return []

    async def preflight(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        return None


def engines_of(targets: Any) -> list[Any]:
    """Flatten engines, lists of engines and routers (their admitted engines) into a list."""
    if isinstance(targets, (list, tuple)):
        return [e for t in targets for e in engines_of(t)]
    slots = getattr(targets, "slots", None)
    if slots is not None:  # a Router: push to the engines it sends work to
        return [s.engine for s in slots if s.healthy]
    return [targets]


def engine_name(engine: Any, index: int) -> str:
    return str(getattr(engine, "name", None) or f"engine{index}")


async def verify_versions(engines: Sequence[Any], version: int) -> None:
    import asyncio

    found = await asyncio.gather(*(engine_version(e) for e in engines), return_exceptions=True)
    bad = [f"{engine_name(e, i)} reports {v!r}" if not isinstance(v, BaseException)
           else f"{engine_name(e, i)} did not answer ({type(v).__name__}: {v})"
           for i, (e, v) in enumerate(zip(engines, found)) if v != version]
    if bad:
        raise WeightPushError(f"after pushing weight version {version}: " + "; ".join(bad)
                              + ". These engines missed the push; their samples would carry a version whose "
                                "weights they do not hold, so the run stops here")

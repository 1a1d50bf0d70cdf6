"""The weight-transport contract: push named tensors to every rollout engine under a version.

A push pauses the engines (so no token is sampled from half-updated weights), moves the
tensors, resumes, then *verifies*: every engine must report exactly the pushed version, read
back from the engine itself (an HTTP engine is asked, not its client's cache). An engine
that missed a push raises :class:`WeightPushError` — its samples would otherwise be labelled
with a version whose weights it does not hold.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from miles_engine.engines.protocol import engine_version
from miles_engine.errors import MilesError
from miles_engine.models.adapters import base_digest

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
        baseline's names, dtypes and shapes); engines keep their bases for adapter-only pushes."""
        ...


class TransportBase:
    """The no-op defaults of a transport's optional abilities (:class:`WeightTransport`)."""

    async def rewind(self, version: int) -> list[int]:
        return []

    async def preflight(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Adapter-only pushes: the engines keep their bases, checked equal to the trainer's."""
        await keep_bases(engines_of(getattr(self, "targets", [])), named_tensors)


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
    found = await asyncio.gather(*(engine_version(e) for e in engines), return_exceptions=True)
    bad = [f"{engine_name(e, i)} reports {v!r}" if not isinstance(v, BaseException)
           else f"{engine_name(e, i)} did not answer ({type(v).__name__}: {v})"
           for i, (e, v) in enumerate(zip(engines, found)) if v != version]
    if bad:
        raise WeightPushError(f"after pushing weight version {version}: " + "; ".join(bad)
                              + ". These engines missed the push; their samples would carry a version whose "
                                "weights they do not hold, so the run stops here")


_SHOW_BASES = 3


async def keep_bases(engines: Sequence[Any], exported: Any) -> None:
    """Before the first adapter-only push (``weights.lora=adapters``): every engine keeps the base it
    loaded for each adapted weight, and that base must be the trainer's, bit for bit in float32 --
    adapters merged into any other base would not give the weights the trainer computes with. No-op
    unless ``exported`` is an adapter export (it carries ``bases``)."""
    bases = getattr(exported, "bases", None)
    if not bases:
        return
    names = sorted(bases)
    want = await asyncio.to_thread(lambda: {w: base_digest(bases[w]) for w in names})
    for i, engine in enumerate(engines):
        keep = getattr(engine, "keep_lora_base", None)
        if keep is None:
            raise WeightPushError(f"{engine_name(engine, i)} ({type(engine).__name__}) cannot keep base weights for "
                                  f"adapter-only pushes; set weights.lora=merged")
        try:
            got = await keep(names)
        except Exception as exc:
            raise WeightPushError(f"{engine_name(engine, i)} could not keep its base weights for adapter-only pushes: "
                                  f"{exc}") from exc
        differ = [w for w in names if got.get(w) != want[w]]
        if differ:
            more = f" (and {len(differ) - _SHOW_BASES} more)" if len(differ) > _SHOW_BASES else ""
            raise WeightPushError(
                f"{engine_name(engine, i)} holds base weights other than the trainer's: {', '.join(differ[:_SHOW_BASES])}"
                f"{more} differ in float32. Adapters merged into them would not give the trainer's weights: the "
                f"engines must load the model the trainer started from, in float32 (or one whose values "
                f"the engine's dtype holds exactly), or set weights.lora=merged")

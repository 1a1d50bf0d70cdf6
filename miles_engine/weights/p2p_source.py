"""The trainer ranks' side of the ``p2p`` transport: functions the driver runs on every rank
(``FSDPTrainer.call(fn, *args)``, or in this process for a one-process trainer), each given the
rank's trainer first.

Every rank gathers the full policy tensors (``trainer.full_tensors()``: an all-gather under
FSDP2, so each rank holds a full copy and can be a source) and keeps them staged under the push's
version (the newest two: an engine restarted while the next push is staged gets the one it
missed); :func:`send` then writes the buckets the plan gave this rank to its targets, point to
point, through two reusable staging buffers: a round's sends are in flight while the next round is
packed, so memory stays two rounds of buckets however many engines there are. A failed write
stops this rank's sends and is reported (target, tensor, why), never raised: the trainer stays up
and the driver fails the update. Results of every rank come back through rank 0
(``all_gather_object`` on the trainer's own group).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

_GROUPS: dict[str, tuple[Any, str]] = {}  # group name -> (this rank's handle in the weight-sync group, backend)
_STAGED: dict[int, dict[str, Any]] = {}  # version -> tensors: the newest two (a restart may want the one before)


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


def _everyone(value: Any) -> list[Any]:
    """``value`` of every trainer rank, in rank order (a collective on the trainer's group)."""
    import torch.distributed as tdist

    rank, world = _rank_and_world()
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    tdist.all_gather_object(out, value)
    return out


def join(trainer: Any, address: str, port: int, world: int, group_name: str, backend: str,
         timeout_s: float) -> list[str | None]:
    """This rank joins the group as its own trainer rank; every rank's error (None: joined)."""
    from miles_engine.weights import dist

    rank, _ = _rank_and_world()
    try:
        handle = dist.new_group(backend, master_address=address, master_port=port, rank=rank, world_size=world,
                                group_name=group_name, timeout_s=timeout_s)
        _GROUPS[group_name] = (handle, backend)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the driver with the other ranks'
        error = f"trainer rank {rank}: {type(exc).__name__}: {exc}"
    return _everyone(error)


def leave(trainer: Any, group_name: str) -> None:
    from miles_engine.weights import dist

    dist.abort_group(_GROUPS.pop(group_name, (None, ""))[0])


def stage(trainer: Any, version: int) -> list[tuple[str, str, tuple[int, ...], int]]:
    """Gather the full tensors on every rank and keep them for ``version``; their specs."""
    from miles_engine.weights.tensors import dtype_name

    live = {getattr(p, "_local_tensor", p).data_ptr() for p in trainer.policy.parameters()}
    tensors = {n: t.clone() if t.data_ptr() in live else t for n, t in trainer.full_tensors().items()}  # owned copies
    _STAGED[version] = tensors
    for old in sorted(_STAGED)[:-2]:
        del _STAGED[old]
    return [(n, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for n, t in tensors.items()]


def _tensors(version: int) -> dict[str, Any]:
    if version not in _STAGED:
        raise RuntimeError(f"this trainer rank holds versions {sorted(_STAGED)} of its exports, not {version}")
    return _STAGED[version]


def digests(trainer: Any, version: int, dtypes: Mapping[str, str]) -> dict[str, str]:
    from miles_engine.weights.check.compare import as_held
    from miles_engine.weights.tensors import digest

    return {n: digest(as_held(t, dtypes[n], n) if n in dtypes else t) for n, t in _tensors(version).items()}


def fetch(trainer: Any, version: int, names: Sequence[str] | None) -> dict[str, Any]:
    staged = _tensors(version)
    return {n: t.clone() for n, t in staged.items() if names is None or n in names}


def send(trainer: Any, group_name: str, version: int, jobs: Mapping[int, Sequence[tuple[int, list[list[tuple[str, str]]]]]],
         ) -> list[dict[str, Any]]:
    """Send this rank's share: ``jobs[rank]`` = ``[(target's group rank, [bucket: [(name, dtype)]])]``.
    Round k sends every target's k-th bucket; each distinct bucket is packed once."""
    import torch

    from miles_engine.weights import dist, tensors

    rank, _ = _rank_and_world()
    t0 = time.perf_counter()
    sent, error = 0, None
    try:
        group, backend = _GROUPS[group_name]
        staged = _tensors(version)
        device = dist.comm_device(backend)
        mine = jobs.get(rank, [])
        rounds = max((len(buckets) for _, buckets in mine), default=0)
        pending: list[tuple[Any, int, str]] = []  # the previous round's sends (work, target, first tensor)
        for k in range(rounds):
            packed: dict[tuple[tuple[str, str], ...], Any] = {}
            works = []
            for target, buckets in mine:
                if k >= len(buckets):
                    continue
                content = tuple(tuple(x) for x in buckets[k])
                if content not in packed:
                    packed[content] = tensors.pack([staged[n].to(getattr(torch, d)) for n, d in content], device)
                works.append((dist.send(group, packed[content], target), target, content[0][0]))
                sent += packed[content].numel()
            error = _wait(pending)  # the last round lands while this one is in flight
            if error is not None:
                break
            pending = works
        error = error or _wait(pending)
    except Exception as exc:  # noqa: BLE001 - the driver names it with the target
        error = {"target": None, "tensor": None, "why": f"{type(exc).__name__}: {exc}"}
    if error is not None:
        dist.abort_group(_GROUPS.pop(group_name, (None, ""))[0])  # a broken group is rebuilt for the next push
    return _everyone({"rank": rank, "bytes": sent, "seconds": time.perf_counter() - t0, "error": error})


def _wait(pending: list[tuple[Any, int, str]]) -> dict[str, Any] | None:
    for work, target, first in pending:
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001
            return {"target": target, "tensor": first, "why": f"{type(exc).__name__}: {exc}"}
    return None

"""The optimizer state on local disk, streamed bucket by bucket through each update
(``trainer.optimizer_state: disk``).

Forward and backward never read the optimizer state: Adam's two moments (and its step count) are
needed only by ``optimizer.step()``, yet they are twice the weights' bytes and sit in memory the
whole run. :class:`StreamedOptimizerState` keeps them in one file per optimizer and rank instead:

- between updates the optimizer holds no state (``optimizer.state`` is empty);
- an update walks the parameters in buckets of ``trainer.optimizer_bucket_mb``: it reads a
  bucket's state from its file slots (a CRC-32 per slot, checked), steps only that bucket (the
  other parameters' gradients are hidden meanwhile), writes the new state back in place and
  drops it, so at most one bucket's state is in memory;
- the update is the optimizer's own ``step`` on each parameter with the state it would have had:
  training is bit-identical to ``memory`` (AdamW updates every parameter on its own);
- a checkpoint (``state_dict``) and a resume (``load_state_dict``) see the whole state
  (:meth:`all_resident`); checkpoints are the same as with ``memory``, so a run may resume with
  either setting, or at another parallel layout.

An FSDP2 rank stores its shards (the DTensor's local tensor) and rebuilds the DTensor from the
parameter's mesh and placements. The file is scratch, written without fsync: a crash resumes from
the last checkpoint. ``streamed_bytes`` and ``stream_s`` count what an update read and wrote.
"""

from __future__ import annotations

import contextlib
import os
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles_engine.trainer.offload import scratch_path

class OptimizerStateError(RuntimeError):
    """The optimizer state read back from its file is not what was written (the update must not run on it)."""


@dataclass
class _Slot:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    dtensor: bool  # rebuilt as a DTensor like its parameter (FSDP2)
    crc: int = 0


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _state_nbytes(p: torch.Tensor) -> int:
    """Adam's two moments of ``p`` (its step count is a scalar)."""
    local = _local(p)
    return 2 * local.numel() * local.element_size() + 8


class StreamedOptimizerState:
    def __init__(self, optimizer: torch.optim.Optimizer, directory: str | Path, *, bucket_bytes: int,
                 name: str = "optimizer") -> None:
        if bucket_bytes < 1:
            raise ValueError(f"optimizer_bucket_mb must be positive (got {bucket_bytes} bytes)")
        self.optimizer = optimizer
        self.bucket_bytes = bucket_bytes
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = scratch_path(self.directory, name, ".optstate")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._slots: dict[tuple[int, str], _Slot] = {}  # (id(param), state key) -> where it lives
        self._end = 0
        self._resident = False
        self.streamed_bytes = 0
        self.stream_s = 0.0
        self.peak_resident_bytes = 0  # the most state an update held in memory at once

    # ------------------------------------------------------------------ buckets
    def params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def buckets(self) -> list[list[torch.Tensor]]:
        """The parameters with a gradient, in order, cut where a bucket's state would pass ``bucket_bytes``."""
        out: list[list[torch.Tensor]] = [[]]
        size = 0
        for p in self.params():
            if p.grad is None:
                continue
            need = _state_nbytes(p)
            if out[-1] and size + need > self.bucket_bytes:
                out.append([])
                size = 0
            out[-1].append(p)
            size += need
        return [b for b in out if b]

    # ------------------------------------------------------------------ the update
    def step(self) -> None:
        """``optimizer.step()``, one bucket of state in memory at a time."""
        if self._resident:
            self.optimizer.step()
            return
        buckets = self.buckets()
        grads = {id(p): p.grad for b in buckets for p in b}
        try:
            for p in (p for b in buckets for p in b):
                p.grad = None
            for bucket in buckets:
                for p in bucket:
                    p.grad = grads[id(p)]
                self._load(bucket)
                self.optimizer.step()
                self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes())
                self._store(bucket)
                for p in bucket:
                    p.grad = None
        finally:
            for p in (p for b in buckets for p in b):
                p.grad = grads[id(p)]

    @contextlib.contextmanager
    def all_resident(self) -> Iterator[None]:
        """The whole state in ``optimizer.state`` (a checkpoint reads it, a resume writes it);
        written back and dropped on exit."""
        if self._resident:
            yield
            return
        params = self.params()
        self._load(params)
        self._resident = True
        try:
            yield
        finally:
            self._resident = False
            self._store([p for p in params if p in self.optimizer.state])

    def figures(self) -> dict[str, float]:
        """Bytes read + written and seconds spent on the file since the last call (one update's)."""
        out = {"optimizer_stream_bytes": float(self.streamed_bytes), "optimizer_stream_s": self.stream_s}
        self.streamed_bytes, self.stream_s = 0, 0.0
        return out

    def resident_bytes(self) -> int:
        return sum(_local(v).numel() * _local(v).element_size() for s in self.optimizer.state.values()
                   for v in s.values() if isinstance(v, torch.Tensor))

    # ------------------------------------------------------------------ file slots
    def _load(self, params: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        for p in params:
            keys = [k for (pid, k) in self._slots if pid == id(p)]
            if keys:
                self.optimizer.state[p] = {k: self._read(p, self._slots[(id(p), k)], k) for k in keys}
        self.stream_s += time.perf_counter() - t0

    def _store(self, params: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        for p in params:
            state = self.optimizer.state.pop(p, None)
            for key, value in (state or {}).items():
                if not isinstance(value, torch.Tensor):
                    raise OptimizerStateError(f"optimizer state {key!r} is {type(value).__name__}: only tensors stream")
                self._write(p, key, value)
        self.stream_s += time.perf_counter() - t0

    def _write(self, p: torch.Tensor, key: str, value: torch.Tensor) -> None:
        local = _local(value).detach()
        data = local.to("cpu").contiguous().reshape(-1).view(torch.uint8)
        slot = self._slots.get((id(p), key))
        if slot is None or slot.nbytes != data.numel():
            slot = _Slot(self._end, data.numel(), local.dtype, tuple(local.shape), _local(value) is not value)
            self._end += -(-slot.nbytes // 4096) * 4096
            self._slots[(id(p), key)] = slot
        view = memoryview(data.numpy())
        slot.crc = zlib.crc32(view)
        written = os.pwrite(self._fd, view, slot.offset)
        if written != slot.nbytes:
            raise OptimizerStateError(f"{self.path}: wrote {written} of {slot.nbytes} bytes of {key!r}")
        self.streamed_bytes += slot.nbytes

    def _read(self, p: torch.Tensor, slot: _Slot, key: str) -> torch.Tensor:
        buf = torch.empty(slot.nbytes, dtype=torch.uint8)
        got = os.preadv(self._fd, [memoryview(buf.numpy())], slot.offset)
        if got != slot.nbytes or zlib.crc32(memoryview(buf.numpy())) != slot.crc:
            raise OptimizerStateError(f"{self.path}: the optimizer state {key!r} of a parameter of shape "
                                      f"{tuple(p.shape)} came back {'short' if got != slot.nbytes else 'changed'} "
                                      f"(CRC-32 mismatch); the update does not run on it")
        self.streamed_bytes += slot.nbytes
        local = buf.view(slot.dtype).reshape(slot.shape)
        device = _local(p).device if slot.shape else torch.device("cpu")  # Adam keeps its step count on the CPU
        local = local.to(device)
        if not slot.dtensor:
            return local
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self.path.unlink(missing_ok=True)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def for_optimizer(optimizer: torch.optim.Optimizer, mode: str, directory: str | None, bucket_mb: float,
                  name: str) -> StreamedOptimizerState | None:
    """``trainer.optimizer_state``: None for ``memory``; ``disk``: the state's file in ``directory``
    (default: ``$TMPDIR``)."""
    if mode != "disk":
        return None
    import tempfile

    return StreamedOptimizerState(optimizer, directory or tempfile.gettempdir(),
                                  bucket_bytes=max(int(bucket_mb * 2**20), 1), name=name)


def stream_state(trainer: Any, optimizer: torch.optim.Optimizer, role: str) -> None:
    """Register ``optimizer``'s stream in ``trainer.streams`` when its config says ``disk``."""
    cfg = trainer.config
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    stream = for_optimizer(optimizer, cfg.optimizer_state, cfg.optimizer_state_dir, cfg.optimizer_bucket_mb,
                           name=f"trainer-rank{rank}-{role}")
    if stream is not None:
        trainer.streams[id(optimizer)] = stream


@contextlib.contextmanager
def all_resident(streams: Any) -> Iterator[None]:
    """Every streamed optimizer's whole state in memory (a checkpoint, a resume)."""
    with contextlib.ExitStack() as stack:
        for stream in streams:
            stack.enter_context(stream.all_resident())
        yield

"""Trainer state out of memory while the trainer waits (``trainer.offload``).

Between a step's weight push and the next step the trainer computes nothing, yet its weights,
gradient buffers and optimizer state hold device memory that colocated engines (or, on a CPU
box, everything else) could use. :class:`Offloader` moves every storage those tensors live in
out and back:

- ``disk``: the bytes go to one file in ``trainer.offload_dir`` (a CRC-32 per storage, checked
  on the way back) and the storage shrinks to nothing;
- ``host``: the bytes go to host memory (pinned where CUDA is) and the device storage shrinks.

Storages are resized in place (``untyped_storage().resize_``), the way FSDP frees unsharded
parameters: every view of them (tied weights, FSDP2's shards, an optimizer's references, the
last pushed tensors) stays the same object and sees the same values after :meth:`restore`, so
training is bit-identical to ``none``. The file is scratch: a crash while offloaded resumes
from the last checkpoint, as without offload.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

OffloadMode = Literal["none", "host", "disk"]
KINDS = ("weights", "grads", "optimizer")


F = TypeVar("F", bound=Callable[..., Any])


class OffloadError(RuntimeError):
    """An offloaded state could not be brought back intact (the step must not run on it)."""


@dataclass
class _Stored:
    storage: torch.UntypedStorage
    kind: str
    nbytes: int
    offset: int = 0  # disk: where its bytes start in the file
    crc: int = 0  # disk: CRC-32 of its bytes
    copy: torch.Tensor | None = None  # host: its bytes


@dataclass
class OffloadReport:
    """What one offload moved (bytes per kind) and how long each direction took."""

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    offload_s: float = 0.0
    reload_s: float = 0.0

    def figures(self) -> dict[str, float]:
        return {**{f"offload_bytes_{k}": float(v) for k, v in self.bytes.items()}, "offload_time": self.offload_s}


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds the data (a DTensor's local shard)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _memory(storage: torch.UntypedStorage) -> memoryview:
    """The bytes of a CPU storage, without exporting it as a buffer: a numpy or buffer view would
    mark the storage unresizable for good."""
    return memoryview((ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())).cast("B")


def remove_stale(directory: Path, suffix: str = ".offload") -> None:
    """Scratch files (``<name>-<pid><suffix>``) of processes that died (SIGKILL) while holding them:
    never read again (a resumed run's state comes from its checkpoint)."""
    for path in directory.glob(f"*-*{suffix}"):
        pid = path.stem.rsplit("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def scratch_path(directory: Path, name: str, suffix: str) -> Path:
    """A scratch file of this process no other in it shares (two trainers in one process each get
    their own), ``<name>.<n>-<pid><suffix>``; the files of dead processes in ``directory`` are removed."""
    remove_stale(directory, suffix)
    return directory / f"{name}.{next(_SCRATCH)}-{os.getpid()}{suffix}"


_SCRATCH = itertools.count()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _adopt(storage: torch.UntypedStorage, tensors: list[torch.Tensor]) -> torch.UntypedStorage:
    """A copy of a storage that cannot be resized (one ``torch.load`` read from a checkpoint, say,
    which the optimizer keeps as its state), with ``tensors`` (every one of the state's tensors
    on it) moved onto the copy."""
    fresh = torch.empty(storage.nbytes(), dtype=torch.uint8, device=storage.device).untyped_storage()
    _bytes_view(fresh).copy_(_bytes_view(storage))
    with torch.no_grad():
        for t in tensors:
            t.set_(fresh, t.storage_offset(), t.size(), t.stride())
    return fresh


def _return_freed_memory() -> None:
    """glibc keeps freed blocks under its mmap threshold in the heap: hand them back to the OS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass


def state_tensors(modules: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a trainer's state with its kind: parameters, their gradients (``.grad``
    and Megatron's ``.main_grad``), and the optimizers' state tensors."""
    for module in modules:
        for p in module.parameters():
            yield "weights", p
            for grad in (p.grad, getattr(p, "main_grad", None)):
                if isinstance(grad, torch.Tensor):
                    yield "grads", grad
    for opt in optimizers:
        for per_param in opt.state.values():
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    yield "optimizer", value


class Offloader:
    """Moves a trainer's state storages out (:meth:`offload`) and back (:meth:`restore`)."""

    def __init__(self, mode: OffloadMode, directory: str | Path | None = None, *, name: str = "trainer") -> None:
        if mode == "none":
            raise ValueError("Offloader needs mode host or disk")
        self.mode = mode
        self.path = scratch_path(Path(directory or os.environ.get("TMPDIR", "/tmp")), name, ".offload")
        self._stored: list[_Stored] = []
        self.report = OffloadReport()

    @property
    def offloaded(self) -> bool:
        return bool(self._stored)

    def offload(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> OffloadReport:
        """Move every distinct storage of ``tensors`` out; returns the bytes moved per kind."""
        if self._stored:
            return self.report
        t0 = time.perf_counter()
        users: dict[int, list[torch.Tensor]] = {}
        stored: list[_Stored] = []
        for kind, t in tensors:
            local = _local(t)
            storage = local.untyped_storage()
            if storage.nbytes() == 0:
                continue
            if storage.data_ptr() not in users:
                users[storage.data_ptr()] = []
                stored.append(_Stored(storage, kind, storage.nbytes()))
            users[storage.data_ptr()].append(local)
        for s in stored:
            if not s.storage.resizable():
                s.storage = _adopt(s.storage, users[s.storage.data_ptr()])
        report = OffloadReport()
        for s in stored:
            report.bytes[s.kind] += s.nbytes
        if self.mode == "disk":
            self._write(stored)
        else:
            for s in stored:
                pin = s.storage.device.type == "cuda"
                s.copy = torch.empty(s.nbytes, dtype=torch.uint8, pin_memory=pin)
                s.copy.copy_(_bytes_view(s.storage), non_blocking=pin)
            if any(s.storage.device.type == "cuda" for s in stored):
                torch.cuda.synchronize()
        for s in stored:
            s.storage.resize_(0)
        if any(s.storage.device.type == "cpu" for s in stored):
            _return_freed_memory()
        self._stored = stored
        report.offload_s = time.perf_counter() - t0
        self.report = report
        return report

    def restore(self) -> float:
        """Bring every storage back with its bytes (disk: checked against their CRC-32); seconds."""
        if not self._stored:
            return 0.0
        t0 = time.perf_counter()
        if self.mode == "disk":
            self._read(self._stored)  # raises on a bad file: the state stays offloaded, every step refused
        else:
            for s in self._stored:
                s.storage.resize_(s.nbytes)
                _bytes_view(s.storage).copy_(s.copy, non_blocking=True)
                s.copy = None
            if any(s.storage.device.type == "cuda" for s in self._stored):
                torch.cuda.synchronize()
        self._stored = []
        self.path.unlink(missing_ok=True)
        self.report.reload_s = time.perf_counter() - t0
        return self.report.reload_s

    def _write(self, stored: list[_Stored]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        offset = 0
        with open(self.path, "wb") as f:
            for s in stored:
                host = s.storage if s.storage.device.type == "cpu" else s.storage.cpu()
                data = _memory(host)
                s.offset, s.crc = offset, zlib.crc32(data)
                f.write(data)
                offset += s.nbytes

    def _read(self, stored: list[_Stored]) -> None:
        try:
            f = open(self.path, "rb")
        except OSError as exc:
            raise OffloadError(f"trainer.offload=disk: the offloaded state {self.path} is gone ({exc})") from None
        with f:
            for s in stored:
                s.storage.resize_(s.nbytes)
                view = _bytes_view(s.storage)
                host = view if view.device.type == "cpu" else torch.empty(s.nbytes, dtype=torch.uint8)
                data = _memory(host.untyped_storage())
                f.seek(s.offset)
                got = f.readinto(data)
                if got != s.nbytes or zlib.crc32(data) != s.crc:
                    raise OffloadError(f"trainer.offload=disk: {self.path} at byte {s.offset}: the {s.kind} "
                                       f"storage of {s.nbytes} bytes came back {'short' if got != s.nbytes else 'changed'}"
                                       f" (CRC-32 mismatch); the trainer's state is lost: resume from the last "
                                       f"checkpoint")
                if host is not view:
                    view.copy_(host)

    def close(self) -> None:
        self._stored = []
        self.path.unlink(missing_ok=True)


def for_trainer(mode: OffloadMode, directory: str | None, device: torch.device, name: str) -> Offloader | None:
    """The trainer's offloader (None for ``none``); ``host`` on a CPU trainer is refused."""
    if mode == "none":
        return None
    if mode == "host" and device.type == "cpu":
        from miles_engine.errors import ConfigError

        raise ConfigError("trainer.offload='host' moves the trainer's state from its device to host memory, "
                          "but this trainer already runs in host memory (device cpu); use trainer.offload='disk' "
                          "to free it")
    return Offloader(mode, directory, name=name)


def resident(method: F) -> F:
    """A trainer method that reads or writes its state: brings an offloaded state back first."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.offloader is not None and self.offloader.offloaded:
            self.offloader.restore()
        return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]

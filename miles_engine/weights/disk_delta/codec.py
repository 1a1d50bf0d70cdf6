"""Per-tensor byte deltas: canonical bytes, ``xor`` / ``overwrite`` encodings, zstandard, checksums.

Canonical bytes are a tensor's raw little-endian bytes in the baseline's dtype, as a 1-D
``numpy.uint8`` array. ``xor`` stores ``new ^ old`` over the whole tensor (unchanged bytes are
zeros, which zstandard squeezes to almost nothing). ``overwrite`` stores the changed byte
ranges (ranges closer than ``merge_gap`` merged) and their new bytes:

    [n_ranges: u64][gaps: n x u64, byte-shuffled][lengths: n x u64, byte-shuffled][new bytes]

``gaps[i]`` is the number of untouched bytes before range i. Byte-shuffling puts the mostly
zero high bytes of the integers into their own planes, so after zstandard the positions cost
little more than their entropy.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from miles_engine.weights.disk_delta.errors import ChecksumError, CorruptDeltaError, DiskDeltaError

_U64 = np.dtype("<u8")


def canonical(tensor: Any) -> np.ndarray:
    """A torch tensor's bytes as a fresh 1-D uint8 array (its own memory: later steps never leak in)."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().copy() if flat.numel() else np.zeros(0, np.uint8)


def as_tensor(data: np.ndarray, dtype: Any, shape: list[int]) -> Any:
    import torch

    t = torch.from_numpy(data)
    return (t.view(dtype) if t.numel() else torch.empty(0, dtype=dtype)).reshape(tuple(shape))


def checksum(fmt: str, data: np.ndarray) -> str:
    view = memoryview(np.ascontiguousarray(data)).cast("B")
    if fmt == "xxh3_128":
        try:
            import xxhash
        except ImportError:
            raise DiskDeltaError("checksum format xxh3_128 needs the 'xxhash' package (pip install xxhash, or "
                                 "the miles-engine[engine] extra), or set weights.disk_delta.checksum=blake2b_128"
                                 ) from None
        return xxhash.xxh3_128_hexdigest(view)
    if fmt == "blake2b_128":
        return hashlib.blake2b(view, digest_size=16).hexdigest()
    if fmt == "sha256":
        return hashlib.sha256(view).hexdigest()
    raise DiskDeltaError(f"unknown checksum format {fmt!r} (allowed: xxh3_128, blake2b_128, sha256)")


def verify(fmt: str, data: np.ndarray, expected: str, name: str, version: int) -> None:
    got = checksum(fmt, data)
    if got != expected:
        raise ChecksumError(f"weight version {version}: tensor {name!r} patched to {fmt} {got}, the index records "
                            f"{expected}; the delta does not apply to the bytes this engine holds")


def _shuffle(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values.astype(_U64).view(np.uint8).reshape(-1, 8).T).tobytes()


def _unshuffle(raw: memoryview, n: int) -> np.ndarray:
    planes = np.frombuffer(raw, dtype=np.uint8, count=8 * n).reshape(8, n)
    return np.ascontiguousarray(planes.T).view(_U64).reshape(-1).astype(np.int64)


def _positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Every byte position covered by the ranges, in order."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    ends = np.cumsum(lengths)
    offsets = np.repeat(starts - (ends - lengths), lengths)
    return offsets + np.arange(total, dtype=np.int64)


def diff(old: np.ndarray, new: np.ndarray, encoding: str, merge_gap: int = 8) -> tuple[bytes, int] | None:
    """(raw delta, changed byte count), or None when the tensor did not change."""
    if old.shape != new.shape:
        raise DiskDeltaError(f"delta of {old.size} against {new.size} bytes")
    changed = old != new
    count = int(np.count_nonzero(changed))
    if count == 0:
        return None
    if encoding == "xor":
        return np.bitwise_xor(old, new).tobytes(), count
    if encoding != "overwrite":
        raise DiskDeltaError(f"unknown delta encoding {encoding!r} (allowed: xor, overwrite)")
    idx = np.flatnonzero(changed)
    breaks = np.flatnonzero(np.diff(idx) > merge_gap + 1)
    starts = idx[np.concatenate(([0], breaks + 1))]
    ends = idx[np.concatenate((breaks, [idx.size - 1]))] + 1
    lengths = ends - starts
    gaps = starts - np.concatenate(([0], ends[:-1]))
    payload = new[_positions(starts, lengths)]
    header = np.array([starts.size], dtype=_U64).tobytes()
    return header + _shuffle(gaps) + _shuffle(lengths) + payload.tobytes(), count


def patch(old: np.ndarray, raw: bytes | memoryview, encoding: str, where: str) -> np.ndarray:
    """A new array: ``old`` with the delta applied (``old`` is never modified)."""
    raw = memoryview(raw)
    if encoding == "xor":
        if len(raw) != old.size:
            raise CorruptDeltaError(f"{where}: xor delta of {len(raw)} bytes for a {old.size}-byte tensor")
        return np.bitwise_xor(old, np.frombuffer(raw, dtype=np.uint8))
    if encoding != "overwrite":
        raise CorruptDeltaError(f"{where}: unknown encoding {encoding!r}")
    if len(raw) < 8:
        raise CorruptDeltaError(f"{where}: overwrite delta of {len(raw)} bytes has no header")
    n = int(np.frombuffer(raw[:8], dtype=_U64)[0])
    if 8 + 16 * n > len(raw):
        raise CorruptDeltaError(f"{where}: overwrite delta claims {n} ranges but has {len(raw)} bytes")
    gaps = _unshuffle(raw[8:8 + 8 * n], n)
    lengths = _unshuffle(raw[8 + 8 * n:8 + 16 * n], n)
    payload = np.frombuffer(raw[8 + 16 * n:], dtype=np.uint8)
    starts = np.cumsum(gaps + lengths) - lengths
    if payload.size != int(lengths.sum()) or (n and int(starts[-1] + lengths[-1]) > old.size):
        raise CorruptDeltaError(f"{where}: overwrite ranges do not fit a {old.size}-byte tensor "
                                f"({payload.size} payload bytes)")
    out = old.copy()
    out[_positions(starts, lengths)] = payload
    return out


class Zstd:
    """zstandard frames, one per tensor (each decodes on its own)."""

    def __init__(self, level: int = 3) -> None:
        try:
            import zstandard
        except ImportError:
            raise DiskDeltaError("the disk_delta transport needs the 'zstandard' package "
                                 "(pip install zstandard, or the miles-engine[engine] extra)") from None
        self._zstd = zstandard
        self.level = level
        self._c = zstandard.ZstdCompressor(level=level)
        self._d = zstandard.ZstdDecompressor()

    def compress(self, raw: bytes) -> bytes:
        return self._c.compress(raw)

    def decompress(self, data: bytes | memoryview, raw_length: int, where: str) -> bytes:
        try:
            out = self._d.decompress(data, max_output_size=raw_length)
        except self._zstd.ZstdError as exc:
            raise CorruptDeltaError(f"{where}: zstandard frame does not decode: {exc}") from None
        if len(out) != raw_length:
            raise CorruptDeltaError(f"{where}: decoded {len(out)} bytes, the index records {raw_length}")
        return out

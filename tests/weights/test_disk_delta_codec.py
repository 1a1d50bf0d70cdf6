"""disk_delta codec: both encodings round-trip exactly, unchanged tensors cost nothing,
clustered changes cost ~their own size on the wire, and bad payloads are refused."""

from __future__ import annotations

import numpy as np
import pytest

from miles_engine.weights.disk_delta import codec
from miles_engine.weights.disk_delta.errors import ChecksumError, CorruptDeltaError


def _changed(old: np.ndarray, rng: np.random.Generator, rows: int, row_bytes: int = 1024) -> np.ndarray:
    new = old.copy()
    for r in rng.choice(old.size // row_bytes, rows, replace=False):
        new[r * row_bytes:(r + 1) * row_bytes] = rng.integers(0, 256, row_bytes, dtype=np.uint8)
    return new


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_round_trip_and_wire_size(encoding: str) -> None:
    rng = np.random.default_rng(0)
    old = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    new = _changed(old, rng, rows=20)
    z = codec.Zstd(3)
    raw, changed = codec.diff(old, new, encoding)
    assert changed == int(np.count_nonzero(old != new))
    wire = z.compress(raw)
    assert len(wire) <= 1.1 * changed + 256  # clustered changes: ~their own size
    back = codec.patch(old, z.decompress(wire, len(raw), "t"), encoding, "t")
    assert np.array_equal(back, new)
    assert not np.array_equal(old, new)  # patch never modifies its input
    assert codec.diff(new, new.copy(), encoding) is None  # unchanged: skipped


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_scattered_and_edge_changes_round_trip(encoding: str) -> None:
    rng = np.random.default_rng(1)
    old = rng.integers(0, 256, 4097, dtype=np.uint8)
    new = old.copy()
    idx = np.concatenate(([0, old.size - 1], rng.choice(old.size, 300, replace=False)))
    new[idx] ^= rng.integers(1, 256, idx.size, dtype=np.uint8)
    for gap in (0, 1, 7):
        raw, _ = codec.diff(old, new, encoding, merge_gap=gap)
        assert np.array_equal(codec.patch(old, raw, encoding, "t"), new)


def test_corrupt_payloads_are_refused() -> None:
    old = np.arange(256, dtype=np.uint8)
    new = old.copy()
    new[10:20] = 0
    raw, _ = codec.diff(old, new, "overwrite")
    with pytest.raises(CorruptDeltaError, match="do not fit"):
        codec.patch(old, raw[:-3], "overwrite", "v1 't'")
    with pytest.raises(CorruptDeltaError, match="xor delta of 255 bytes"):
        codec.patch(old, codec.diff(old, new, "xor")[0][:-1], "xor", "v1 't'")
    with pytest.raises(CorruptDeltaError, match="zstandard"):
        codec.Zstd().decompress(b"not a frame", 10, "v1 't'")


@pytest.mark.parametrize("fmt", ["xxh3_128", "blake2b_128", "sha256"])
def test_checksums_are_of_the_bytes(fmt: str) -> None:
    a = np.arange(100, dtype=np.uint8)
    assert codec.checksum(fmt, a) == codec.checksum(fmt, a.copy())
    with pytest.raises(ChecksumError, match="tensor 'w'"):
        codec.verify(fmt, a[::-1].copy(), codec.checksum(fmt, a), "w", 3)

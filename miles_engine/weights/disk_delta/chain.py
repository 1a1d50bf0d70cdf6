"""Reading deltas: resolve the chain of versions from what is held to a target, pull their
payloads, patch canonical bytes and verify every patched tensor — shared by the engine side
and by a trainer that rebuilds its state from disk.

Lineage: each delta names its base version; a delta is applied only onto exactly that
version. Applying one to another base, twice, or moving backwards is refused
(:class:`LineageError`); every patched tensor must also hash to its recorded checksum.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from miles_engine.weights.disk_delta import codec
from miles_engine.weights.disk_delta.errors import CorruptDeltaError, DiskDeltaError, LineageError
from miles_engine.weights.disk_delta.layout import VersionIndex, read_index, version_dir


def resolve(root: Path, held: int, target: int) -> list[VersionIndex]:
    """The deltas leading from ``held`` to ``target``, oldest first."""
    if target < held:
        raise LineageError(f"asked for weight version {target} while holding {held}: that would roll back to older "
                           f"weights; refused")
    chain: list[VersionIndex] = []
    v = target
    while v != held:
        index = read_index(root, v)
        if index.kind != "delta" or index.base_version is None:
            raise LineageError(f"weight version {v} is a {index.kind}, not a delta; it cannot be reached from the "
                               f"held version {held}")
        if index.base_version < held:
            raise LineageError(f"weight version {v} is a delta on version {index.base_version}, but version {held} "
                               f"is held: it does not apply here")
        chain.append(index)
        v = index.base_version
    return chain[::-1]


@dataclass
class Pulled:
    index: VersionIndex
    payloads: dict[str, bytes]
    wire_bytes: int
    pull_s: float


def pull(root: Path, index: VersionIndex) -> Pulled:
    """Read every changed tensor's compressed span from its shard."""
    started = time.perf_counter()
    d = version_dir(root, index.version)
    by_shard: dict[str, list[str]] = defaultdict(list)
    for name, entry in index.tensors.items():
        by_shard[entry.shard].append(name)
    payloads: dict[str, bytes] = {}
    wire = 0
    for shard, names in by_shard.items():
        path = d / shard
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise CorruptDeltaError(f"weight version {index.version}: shard {path} is missing") from None
        with f:
            for name in sorted(names, key=lambda n: index.tensors[n].offset):
                e = index.tensors[name]
                f.seek(e.offset)
                data = f.read(e.length)
                if len(data) != e.length:
                    raise CorruptDeltaError(f"weight version {index.version}: shard {path} ends before tensor "
                                            f"{name!r} ({len(data)} of {e.length} bytes at offset {e.offset})")
                payloads[name] = data
                wire += e.length
    return Pulled(index, payloads, wire, time.perf_counter() - started)


def patch_versions(state: dict[str, np.ndarray], held: int, pulled: list[Pulled],
                   zstd: codec.Zstd | None = None) -> tuple[dict[str, np.ndarray], int]:
    """Apply the pulled versions in order onto ``state`` (not modified). Returns the patched
    tensors (name -> new bytes) and the version they make up; raises before returning on any
    lineage, decoding or checksum problem."""
    overlay: dict[str, np.ndarray] = {}
    current = held
    for p in pulled:
        index = p.index
        if index.base_version != current:
            raise LineageError(f"weight version {index.version} is a delta on version {index.base_version}, but the "
                               f"bytes here are version {current} (wrong base, or applied twice): refused, nothing "
                               f"changed")
        for name, entry in index.tensors.items():
            where = f"weight version {index.version}, tensor {name!r}"
            old = overlay.get(name)
            old = state.get(name) if old is None else old
            if old is None:
                raise DiskDeltaError(f"{where}: no such tensor here")
            if old.size != entry.nbytes:
                raise CorruptDeltaError(f"{where}: {entry.nbytes} bytes in the index, {old.size} here")
            raw: bytes = p.payloads[name]
            if index.compression == "zstd":
                raw = (zstd or codec.Zstd()).decompress(raw, entry.raw_length, where)
            new = codec.patch(old, raw, index.encoding, where)
            codec.verify(index.checksum, new, entry.checksum, name, index.version)
            overlay[name] = new
        current = index.version
    return overlay, current


def replay(root: Path, state: dict[str, np.ndarray], held: int, target: int) -> int:
    """Bring ``state`` (modified in place) from ``held`` to ``target`` through the chain on disk."""
    chain = resolve(root, held, target)
    overlay, version = patch_versions(state, held, [pull(root, i) for i in chain])
    state.update(overlay)
    return version

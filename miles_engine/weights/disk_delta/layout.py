"""On-disk layout of a publish root, and the index that makes a version complete.

    ROOT/weight_v000000/   version 0: the canonical safetensors baseline + index.json
    ROOT/weight_v000007/   a delta: shard-<source>-NNN.bin files, part-<source>.json, index.json
    ROOT/leases/<engine>.json   the version each live engine holds (garbage collection reads them)

A version is complete exactly when its ``index.json`` exists: shards and parts are fsynced
first, the index is written to a temp file, fsynced, renamed into place, and the directory is
fsynced. A directory without an index is torn and never activated.

Index (JSON, ``format: "miles-disk-delta/1"``): ``version``, ``base_version`` (None for the
baseline), ``kind`` (baseline | delta), ``encoding`` (full | xor | overwrite), ``compression``
(none | zstd), ``checksum`` (the hash of each tensor's *final* bytes: ``xxh3_128``,
``blake2b_128`` (16-byte digest) or ``sha256``, lowercase hex), and ``tensors``:
name -> dtype, shape, nbytes, shard, offset, length (the compressed span in the shard),
raw_length, changed_bytes, checksum. A delta lists only tensors that changed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Literal

from miles_engine.components import Section
from miles_engine.weights.disk_delta.errors import CorruptDeltaError, TornVersionError

FORMAT = "miles-disk-delta/1"
INDEX = "index.json"
_VERSION_DIR = re.compile(r"^weight_v(\d{6,})$")


class TensorEntry(Section):
    dtype: str
    shape: list[int]
    nbytes: int
    shard: str
    offset: int
    length: int
    raw_length: int
    changed_bytes: int
    checksum: str


class VersionIndex(Section):
    format: Literal["miles-disk-delta/1"] = FORMAT
    version: int
    base_version: int | None
    kind: Literal["baseline", "delta"]
    encoding: Literal["full", "xor", "overwrite"]
    compression: Literal["none", "zstd"]
    compression_level: int = 0
    checksum: str
    sources: list[str] = []
    total_tensors: int
    total_bytes: int
    changed_bytes: int
    wire_bytes: int
    tensors: dict[str, TensorEntry]


def version_dir(root: Path, version: int) -> Path:
    if version < 0:
        raise ValueError(f"weight versions are >= 0, got {version}")
    return Path(root) / f"weight_v{version:06d}"


def version_of(path: Path) -> int | None:
    m = _VERSION_DIR.match(path.name)
    return int(m.group(1)) if m else None


def scan(root: Path) -> tuple[list[int], list[int]]:
    """(complete versions, torn versions), each ascending."""
    complete, torn = [], []
    if not Path(root).is_dir():
        return complete, torn
    for child in Path(root).iterdir():
        v = version_of(child)
        if v is None or not child.is_dir():
            continue
        (complete if (child / INDEX).is_file() else torn).append(v)
    return sorted(complete), sorted(torn)


def read_index(root: Path, version: int) -> VersionIndex:
    d = version_dir(root, version)
    path = d / INDEX
    if not path.is_file():
        state = "is torn (its publish never completed)" if d.is_dir() else "does not exist"
        raise TornVersionError(f"weight version {version} {state}: no {path}")
    try:
        index = VersionIndex.model_validate_json(path.read_bytes())
    except ValueError as exc:
        raise CorruptDeltaError(f"{path} is not a valid disk-delta index: {exc}") from None
    if index.version != version:
        raise CorruptDeltaError(f"{path} records version {index.version}, its directory says {version}")
    return index


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file, fsync, atomic rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_index(root: Path, index: VersionIndex) -> Path:
    path = version_dir(root, index.version) / INDEX
    write_durable(path, index.model_dump_json(indent=1).encode())
    return path


def write_json(path: Path, payload: dict) -> None:
    write_durable(path, json.dumps(payload, indent=1).encode())


def discard_after(root: Path, version: int) -> list[int]:
    """Remove every version newer than ``version``, complete or torn; returns their numbers.

    Each index goes first (durably), so a crash midway leaves torn versions, which are never
    activated and are cleaned up on the next open, rather than a hole in a complete chain."""
    import shutil

    complete, torn = scan(root)
    doomed = sorted(v for v in (*complete, *torn) if v > version)
    for v in reversed(doomed):  # newest first: the chain below stays contiguous throughout
        d = version_dir(root, v)
        (d / INDEX).unlink(missing_ok=True)
        fsync_dir(d)
        shutil.rmtree(d, ignore_errors=True)
    if doomed:
        fsync_dir(Path(root))
    return doomed

"""Trainer side: write a version's shards per source, then commit its index.

One ``SourceWriter`` per source (a trainer rank, or the single trainer) keeps the canonical
bytes of the tensors it publishes as of the last committed version and diffs against them.
``write_part`` writes that source's shards (fsynced) and ``part-<source>.json``;
``commit`` (once, by a coordinator) checks the parts against each other — a tensor held by
several sources must end with the same checksum everywhere, else the publish fails and the
version directory is removed before any index exists, so no engine ever loads it — and writes
the index last. ``DeltaPublisher`` is the one-source case the transport uses.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from miles_engine.weights.disk_delta import codec
from miles_engine.weights.disk_delta.errors import DiskDeltaError, LineageError, ReplicaConflictError
from miles_engine.weights.disk_delta.layout import (
    INDEX, TensorEntry, VersionIndex, fsync_dir, scan, version_dir, write_index, write_json)
from miles_engine.weights.disk_delta.options import DiskDeltaOptions


def part_path(root: Path, version: int, source: str) -> Path:
    return version_dir(root, version) / f"part-{source}.json"


@dataclass
class PartStats:
    source: str
    version: int
    changed_tensors: int = 0
    changed_bytes: int = 0
    total_bytes: int = 0
    wire_bytes: int = 0
    write_s: float = 0.0


class _Shards:
    """Appends compressed payloads to ``shard-<source>-NNN.bin`` files, fsyncing each one it closes."""

    def __init__(self, directory: Path, source: str, limit: int) -> None:
        self.directory, self.source, self.limit = directory, source, limit
        self.count = 0
        self.file: BinaryIO | None = None
        self.name = ""
        self.size = 0

    def append(self, data: bytes) -> tuple[str, int]:
        if self.file is None or (self.size and self.size + len(data) > self.limit):
            self.close()
            self.name = f"shard-{self.source}-{self.count:03d}.bin"
            self.count += 1
            self.file = open(self.directory / self.name, "wb")
            self.size = 0
        offset = self.size
        self.file.write(data)
        self.size += len(data)
        return self.name, offset

    def close(self) -> None:
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.file = None


class SourceWriter:
    def __init__(self, root: Path, source: str, state: dict[str, np.ndarray], version: int,
                 options: DiskDeltaOptions) -> None:
        if not source or not source.replace("-", "").replace("_", "").isalnum():
            raise DiskDeltaError(f"source name {source!r} must be non-empty letters, digits, '-' or '_'")
        self.root, self.source, self.state, self.version, self.options = Path(root), source, state, version, options
        self.zstd = codec.Zstd(options.compression_level)
        self._pending: tuple[int, dict[str, np.ndarray]] | None = None

    def write_part(self, version: int, named: Iterable[tuple[str, Any]]) -> PartStats:
        if version <= self.version:
            raise LineageError(f"source {self.source}: version {version} is not newer than {self.version}, the last "
                               f"one it published; weight versions only move forward")
        _refuse_published(self.root, version)
        started = time.perf_counter()
        d = version_dir(self.root, version)
        d.mkdir(parents=True, exist_ok=True)
        opts, stats = self.options, PartStats(self.source, version)
        shards = _Shards(d, self.source, opts.shard_bytes)
        entries: dict[str, dict[str, Any]] = {}
        held: dict[str, str] = {}
        sizes: dict[str, int] = {}
        pending: dict[str, np.ndarray] = {}
        try:
            for name, tensor in named:
                old = self.state.get(name)
                if old is None:
                    raise DiskDeltaError(f"source {self.source}: tensor {name!r} is not in version {self.version} "
                                         f"it diffs against")
                new = codec.canonical(tensor)
                held[name] = codec.checksum(opts.checksum, new)
                sizes[name] = new.size
                stats.total_bytes += new.size
                delta = codec.diff(old, new, opts.encoding, opts.merge_gap)
                if delta is None:
                    continue
                raw, changed = delta
                data = self.zstd.compress(raw)
                shard, offset = shards.append(data)
                entries[name] = TensorEntry(
                    dtype=str(tensor.dtype).removeprefix("torch."), shape=list(tensor.shape), nbytes=new.size,
                    shard=shard, offset=offset, length=len(data), raw_length=len(raw), changed_bytes=changed,
                    checksum=held[name]).model_dump()
                pending[name] = new
                stats.changed_tensors += 1
                stats.changed_bytes += changed
                stats.wire_bytes += len(data)
        finally:
            shards.close()
        write_json(part_path(self.root, version, self.source),
                   {"source": self.source, "version": version, "base_version": self.version,
                    "encoding": opts.encoding, "checksum": opts.checksum, "entries": entries, "held": held,
                    "sizes": sizes})
        self._pending = (version, pending)
        stats.write_s = time.perf_counter() - started
        return stats

    def advance(self, version: int) -> None:
        """The version's index exists: its bytes become what later versions diff against."""
        if self._pending is None or self._pending[0] != version:
            raise DiskDeltaError(f"source {self.source}: no written part of version {version} to advance to")
        if not (version_dir(self.root, version) / INDEX).is_file():
            raise DiskDeltaError(f"source {self.source}: version {version} has no index; it was never committed")
        self.state.update(self._pending[1])
        self.version, self._pending = version, None

    def abandon(self) -> None:
        self._pending = None


def _refuse_published(root: Path, version: int) -> None:
    if (version_dir(root, version) / INDEX).exists():
        raise LineageError(f"weight version {version} is already published under {root}; a version is written "
                           f"once and never replaced")


def commit(root: Path, version: int, sources: list[str], options: DiskDeltaOptions) -> VersionIndex:
    """Check every source's part and write the version's index (last). On any problem the
    version directory is removed and nothing was published."""
    _refuse_published(root, version)
    d = version_dir(root, version)
    try:
        parts = []
        for source in sources:
            path = part_path(root, version, source)
            if not path.is_file():
                raise DiskDeltaError(f"version {version}: source {source!r} wrote no part ({path} is missing)")
            parts.append(json.loads(path.read_text()))
        bases = {p["base_version"] for p in parts}
        if len(bases) != 1:
            raise LineageError(f"version {version}: sources diff against different versions "
                               f"{ {p['source']: p['base_version'] for p in parts} }")
        held: dict[str, dict[str, str]] = {}
        sizes: dict[str, int] = {}
        for p in parts:
            for name, digest in p["held"].items():
                held.setdefault(name, {})[p["source"]] = digest
            sizes.update(p["sizes"])
        conflicts = [f"{name!r} (" + ", ".join(f"{s}: {c}" for s, c in by.items()) + ")"
                     for name, by in held.items() if len(set(by.values())) > 1]
        if conflicts:
            raise ReplicaConflictError(f"version {version}: {len(conflicts)} replicated tensors differ between "
                                       f"sources, nothing was published: " + "; ".join(conflicts))
        entries: dict[str, TensorEntry] = {}
        for p in parts:
            for name, entry in p["entries"].items():
                entries.setdefault(name, TensorEntry.model_validate(entry))
        index = VersionIndex(
            version=version, base_version=bases.pop(), kind="delta", encoding=options.encoding, compression="zstd",
            compression_level=options.compression_level, checksum=options.checksum, sources=list(sources),
            total_tensors=len(held), total_bytes=sum(sizes.values()),
            changed_bytes=sum(e.changed_bytes for e in entries.values()),
            wire_bytes=sum(e.length for e in entries.values()), tensors=entries)
        fsync_dir(d)
        write_index(root, index)
        return index
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise


@dataclass
class DeltaPublisher:
    """One source (``trainer``) publishing every tensor: ``publish`` = write the part, commit, advance."""

    root: Path
    options: DiskDeltaOptions
    state: dict[str, np.ndarray]
    version: int
    source: str = "trainer"
    writer: SourceWriter = field(init=False)

    def __post_init__(self) -> None:
        self.writer = SourceWriter(self.root, self.source, self.state, self.version, self.options)

    @staticmethod
    def clean_torn(root: Path) -> list[int]:
        """Remove torn version directories (a publish that died before its index); call only
        when no publish is in progress."""
        _, torn = scan(root)
        for v in torn:
            shutil.rmtree(version_dir(root, v), ignore_errors=True)
        return torn

    def publish(self, version: int, named: Iterable[tuple[str, Any]]) -> tuple[VersionIndex, PartStats]:
        if version <= self.version:
            raise LineageError(f"version {version} is not newer than {self.version}, the last one published; "
                               f"weight versions only move forward")
        _refuse_published(self.root, version)
        try:
            stats = self.writer.write_part(version, named)
            index = commit(self.root, version, [self.source], self.options)
        except BaseException:
            self.writer.abandon()
            shutil.rmtree(version_dir(self.root, version), ignore_errors=True)
            raise
        self.writer.advance(version)
        self.version = version
        return index, stats

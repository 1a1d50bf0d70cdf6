"""``RUN_DIR/trajectories.mtr``: the recorded trajectories of a run, append-only, read while written.

One record per trajectory, framed so that a crash mid-write cannot corrupt what came before::

    b"MTR1" | u32 summary_len | u32 body_len | u32 crc32(summary + body) | summary | body

``summary`` is a small JSON object (what lists, filters and curves need: step, ids, reward,
advantage, status, token counts, ...) read without touching the body; ``body`` is zlib-compressed
JSON (the exact token row, per-token log-probs, mask, versions, the conversation, the sandbox's
commands). A torn tail (a crash in the middle of a record) is skipped and counted by the reader and
cut off by the next writer before it appends (``--resume``); a record whose checksum fails is
skipped and counted, the ones after it still read (the lengths say where the next one starts).
"""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRAJECTORIES_FILE = "trajectories.mtr"
MAGIC = b"MTR1"
_HEADER = struct.Struct("<4sIII")
MAX_SUMMARY = 1 << 20  # a summary past this is not one: the framing is broken there
MAX_BODY = 1 << 30


def encode(summary: Mapping[str, Any], body: Mapping[str, Any]) -> bytes:
    s = json.dumps(summary, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    # level 1: ~5x faster than 6 on token rows for ~4 % more bytes (bench/record_overhead.py)
    b = zlib.compress(json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode(), 1)
    return _HEADER.pack(MAGIC, len(s), len(b), zlib.crc32(b, zlib.crc32(s))) + s + b


@dataclass
class ScanResult:
    """Records found from ``start``: (offset, summary) each; ``end``: where the next record would start."""

    records: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    end: int = 0
    torn_bytes: int = 0  # an incomplete record at the end (a crash mid-write, or one being written now)
    corrupt: int = 0  # records whose checksum or summary did not hold


def scan(path: Path, start: int = 0) -> ScanResult:
    """Reads record headers and summaries from ``start`` (bodies only for their checksum)."""
    out = ScanResult(end=start)
    try:
        fh = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        return out
    with fh:
        size = os.fstat(fh.fileno()).st_size
        pos = start
        while pos < size:
            fh.seek(pos)
            head = fh.read(_HEADER.size)
            if len(head) < _HEADER.size:
                break
            magic, slen, blen, crc = _HEADER.unpack(head)
            if magic != MAGIC or slen > MAX_SUMMARY or blen > MAX_BODY:
                out.corrupt += 1  # the framing itself is broken: nothing after it can be trusted
                out.torn_bytes = size - pos
                out.end = pos
                return out
            stop = pos + _HEADER.size + slen + blen
            if stop > size:
                break
            payload = fh.read(slen + blen)
            if zlib.crc32(payload) != crc:
                out.corrupt += 1
            else:
                try:
                    out.records.append((pos, json.loads(payload[:slen])))
                except ValueError:
                    out.corrupt += 1
            pos = stop
        out.end = pos
        out.torn_bytes = size - pos
    return out


def read_body(path: Path, offset: int) -> dict[str, Any]:
    with open(path, "rb") as fh:
        fh.seek(offset)
        magic, slen, blen, _ = _HEADER.unpack(fh.read(_HEADER.size))
        if magic != MAGIC:
            raise ValueError(f"{path}: no record at byte {offset}")
        fh.seek(slen, os.SEEK_CUR)
        return json.loads(zlib.decompress(fh.read(blen)))


class TrajectoryWriter:
    """Appends records; opening it cuts a torn tail left by a crash (counted in ``repaired_bytes``)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / TRAJECTORIES_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        found = scan(self.path)
        self.repaired_bytes = found.torn_bytes
        self.records = len(found.records)
        self._fh = open(self.path, "ab")  # noqa: SIM115 - held for the run
        if found.torn_bytes:
            self._fh.truncate(found.end)
        self._lock = threading.Lock()

    def append(self, records: Iterable[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> int:
        """Writes (summary, body) pairs, flushed; returns the bytes written."""
        encoded = [encode(s, b) for s, b in records]
        data = b"".join(encoded)
        with self._lock:
            self._fh.write(data)  # one write: a crash leaves whole records and at most one torn tail
            self._fh.flush()
            self.records += len(encoded)
        return len(data)

    def truncate_after_step(self, step: int) -> int:
        """Cut the records of steps after ``step`` (``--resume`` from that step's checkpoint runs them
        again); records are appended in step order. Returns how many were cut."""
        with self._lock:
            self._fh.flush()
            found = scan(self.path)
            cut = next((offset for offset, s in found.records if int(s.get("step", 0)) > step), None)
            if cut is None:
                return 0
            n = sum(1 for offset, _ in found.records if offset >= cut)
            self._fh.truncate(cut)
            self.records -= n
            return n

    def close(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.close()


_SORTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "reward": lambda s: (s.get("reward") is None, s.get("reward") or 0.0),
    "advantage": lambda s: (s.get("advantage") is None, s.get("advantage") or 0.0),
    "tokens": lambda s: s.get("tokens", 0),
    "step": lambda s: (s.get("step", 0), s.get("group_id", ""), s.get("index", 0)),
}
FILTERS = ("step", "task_id", "group_id", "status", "kind", "filtered", "has_body", "weight_version")


class TrajectoryStore:
    """A run's records for reading, kept current with :meth:`refresh` (only new bytes are scanned).

    Each summary gets ``rid`` (its byte offset, the key :meth:`get` takes)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / TRAJECTORIES_FILE
        self.summaries: list[dict[str, Any]] = []
        self._by_rid: dict[int, dict[str, Any]] = {}
        self.torn_bytes = 0
        self.corrupt = 0
        self._end = 0
        self._lock = threading.Lock()

    def refresh(self) -> int:
        """Reads records appended since the last call; returns how many."""
        with self._lock:
            found = scan(self.path, self._end)
            for offset, summary in found.records:
                summary["rid"] = offset
                self.summaries.append(summary)
                self._by_rid[offset] = summary
            self._end = found.end
            self.torn_bytes = found.torn_bytes
            self.corrupt += found.corrupt
            return len(found.records)

    def steps(self) -> list[int]:
        return sorted({int(s["step"]) for s in self.summaries if "step" in s})

    def query(self, *, offset: int = 0, limit: int = 50, sort: str = "step", descending: bool = False,
              **filters: Any) -> tuple[list[dict[str, Any]], int]:
        """One page of summaries matching ``filters`` (equality on the keys in :data:`FILTERS`), and
        how many match in all."""
        unknown = set(filters) - set(FILTERS)
        if unknown:
            raise ValueError(f"unknown filter {sorted(unknown)}; allowed: {', '.join(FILTERS)}")
        if sort not in _SORTS:
            raise ValueError(f"unknown sort {sort!r}; allowed: {', '.join(_SORTS)}")
        wanted = {k: v for k, v in filters.items() if v is not None}
        rows = [s for s in self.summaries if all(s.get(k) == v for k, v in wanted.items())]
        rows.sort(key=_SORTS[sort], reverse=descending)
        return rows[offset:offset + limit], len(rows)

    def get(self, rid: int) -> dict[str, Any]:
        """The whole record (summary and body) at byte offset ``rid``."""
        summary = self._by_rid.get(int(rid))
        if summary is None:
            raise KeyError(f"no trajectory record {rid} in {self.path}")
        return {**summary, **read_body(self.path, rid)}

"""Engine leases and garbage collection of old versions.

Each engine writes ``ROOT/leases/<engine>.json`` (the version it holds, refreshed on every
apply; an engine server persisting its local copy leases the copy's version instead, the one
it would resume from after a restart — see :mod:`.local_copy`). Rule: a complete version ``v`` is deleted only when all hold:
  - ``v`` is not the baseline (version 0);
  - ``v`` is not among the newest ``retain`` complete versions;
  - ``v`` is <= the version every live engine holds (an engine holding ``h`` needs every
    version above ``h`` to catch up; a lease older than ``lease_ttl_s`` is dead).
Torn directories below the newest complete version are debris of a dead publish (versions
only move forward, so none of them can still be in progress) and are removed too.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

from miles_engine.weights.disk_delta.layout import scan, version_dir, write_json

LEASES = "leases"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def lease_path(root: Path, engine: str) -> Path:
    return Path(root) / LEASES / f"{_SAFE.sub('_', engine)}.json"


def write_lease(root: Path, engine: str, version: int) -> None:
    path = lease_path(root, engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"engine": engine, "version": version, "updated": time.time()})


def drop_lease(root: Path, engine: str) -> None:
    lease_path(root, engine).unlink(missing_ok=True)


def live_holds(root: Path, ttl_s: float, now: float | None = None) -> dict[str, int]:
    now = time.time() if now is None else now
    holds: dict[str, int] = {}
    for path in sorted((Path(root) / LEASES).glob("*.json")):
        try:
            lease = json.loads(path.read_text())
            if now - float(lease["updated"]) <= ttl_s:
                holds[str(lease["engine"])] = int(lease["version"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a lease being replaced or garbage: it protects nothing
    return holds


def collect(root: Path, retain: int | None, ttl_s: float) -> list[int]:
    """Delete what the rule above allows; returns the deleted versions (torn ones included)."""
    complete, torn = scan(root)
    removed: list[int] = []
    if complete:
        newest = complete[-1]
        for v in torn:
            if v < newest:
                shutil.rmtree(version_dir(root, v), ignore_errors=True)
                removed.append(v)
    if retain is None or len(complete) <= retain:
        return removed
    holds = live_holds(root, ttl_s)
    floor = min(holds.values()) if holds else complete[-1]
    keep = set(complete[-retain:]) | {0}
    for v in complete:
        if v not in keep and v <= floor:
            # the index goes first: a half-deleted version is torn, never complete
            (version_dir(root, v) / "index.json").unlink(missing_ok=True)
            shutil.rmtree(version_dir(root, v), ignore_errors=True)
            removed.append(v)
    return sorted(removed)

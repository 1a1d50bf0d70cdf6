"""The host's view of a container on a local engine: the processes of its cgroup, and a
SIGKILL of those of one exec (found by the marker in their environment) from outside it."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostProcess:
    pid: int


_CGROUP_GLOBS = ("/sys/fs/cgroup/pids/docker/{id}", "/sys/fs/cgroup/pids/*/docker-{id}.scope",
                 "/sys/fs/cgroup/system.slice/docker-{id}.scope", "/sys/fs/cgroup/docker/{id}",
                 "/sys/fs/cgroup/pids/machine.slice/libpod-{id}.scope", "/sys/fs/cgroup/machine.slice/libpod-{id}.scope")


def container_pids(container_id: str, strict: bool = False) -> list[int]:
    """Host pids in the container's cgroup: its cgroup.procs when found (cheap), else a /proc
    scan (``strict``: an empty list when no cgroup directory is found)."""
    import glob

    for pattern in _CGROUP_GLOBS:
        for d in glob.glob(pattern.format(id=container_id)):
            try:
                return [int(x) for x in Path(d, "cgroup.procs").read_text().split()]
            except OSError:
                continue
    found: list[int] = []
    if strict:
        return found
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if container_id in (d / "cgroup").read_text():
                found.append(int(d.name))
        except OSError:
            continue
    return found


def sigkill_tagged(container_id: str, marker: bytes) -> int:
    """SIGKILL the host processes in ``container_id``'s cgroup whose environment has
    ``marker``; return how many were found."""
    found = 0
    for pid in container_pids(container_id):
        try:
            if marker in Path(f"/proc/{pid}/environ").read_bytes():
                os.kill(pid, signal.SIGKILL)
                found += 1
        except OSError:
            continue
    return found

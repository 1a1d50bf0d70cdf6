"""Finding and killing a sandbox's processes from /proc (works across PID namespaces)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass

from miles_engine.sandbox.local.env import MARKER_VAR


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    state: str
    uids: tuple[int, ...]  # real, effective, saved, filesystem
    cmdline: str


def _read_status(pid: int) -> tuple[str, tuple[int, ...]] | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    state, uids = "?", ()
    for line in text.splitlines():
        if line.startswith("State:"):
            state = line.split()[1]
        elif line.startswith("Uid:"):
            uids = tuple(int(x) for x in line.split()[1:])
    return state, uids


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read(512).replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _has_marker(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False


def pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def find_processes(
    *, uid: int | None = None, sandbox_id: str | None = None, pidns: str | None = None
) -> list[ProcInfo]:
    """Live (non-zombie) processes of one sandbox: any of whose uids is ``uid`` when the
    sandbox has a dedicated uid; else those in PID namespace ``pidns`` or whose environment
    carries the marker for ``sandbox_id``."""
    marker = f"{MARKER_VAR}={sandbox_id}".encode() if sandbox_id else None
    me = os.getpid()
    found: list[ProcInfo] = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        st = _read_status(pid)
        if st is None or st[0] in ("Z", "X"):
            continue
        state, uids = st
        if uid is not None:
            hit = uid in uids  # a dedicated uid is exact: sandbox code cannot change it (no_new_privs)
        else:  # a private PID namespace is exact too; the marker catches processes outside it
            hit = (pidns is not None and pid_namespace(pid) == pidns) or (
                marker is not None and _has_marker(pid, marker)
            )
        if hit:
            found.append(ProcInfo(pid, state, uids, _cmdline(pid)))
    return found


def _kill_everything_of_my_uid() -> None:  # runs in the forked helper, after setuid
    os.kill(-1, signal.SIGKILL)


def kill_uid(uid: int) -> None:
    """SIGKILL every process whose real or saved uid is ``uid``.

    A helper running as ``uid`` calls ``kill(-1, SIGKILL)``: the kernel signals all of
    them under one lock, so a fork bomb cannot outrun it. Requires root.
    """
    subprocess.run(
        ["/bin/true"],
        user=uid,
        group=uid,
        extra_groups=[],
        preexec_fn=_kill_everything_of_my_uid,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
        timeout=10,
        check=False,
    )


def kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def reap_all(
    *, uid: int | None, sandbox_id: str, pidns: str | None = None, extra_pids: list[int] = (), deadline_s: float = 5.0
) -> list[ProcInfo]:
    """Kill every process of a sandbox until none is left (or ``deadline_s`` passes).

    Blocking; call it from a worker thread. Returns what survived (normally empty).
    """
    kill_pids(list(extra_pids))
    end = time.monotonic() + deadline_s
    delay = 0.002
    while True:
        left = find_processes(uid=uid, sandbox_id=sandbox_id, pidns=pidns)
        if not left:
            return []
        if uid is not None:
            kill_uid(uid)
        kill_pids([p.pid for p in left])
        if time.monotonic() > end:
            return find_processes(uid=uid, sandbox_id=sandbox_id, pidns=pidns)
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group_but_leader(pgid: int, sig: int) -> None:
    """Signal every member of process group ``pgid`` except its leader.

    Used for commands entered through ``nsenter``: if nsenter (the leader, outside the
    namespace) died first, its child would be re-parented to the *host* init and the
    namespace could not finish dying until that init reaped it. Killing the members
    first lets nsenter reap its child and exit on its own.
    """
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == pgid:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) != pgid:
                    continue
            os.kill(int(name), sig)
        except (OSError, ValueError, IndexError):
            continue


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False

"""Per-sandbox unprivileged uids (root only), leased across processes with flock."""

from __future__ import annotations

import fcntl
import os
import random
import tempfile
from dataclasses import dataclass

from miles_engine.errors import SandboxError
from miles_engine.sandbox.local import procscan


def _lock_dir() -> str:
    for base in ("/run", tempfile.gettempdir()):
        path = os.path.join(base, "miles-sandbox-uids")
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            st = os.stat(path)
            if st.st_uid == os.geteuid() and os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise SandboxError("cannot create a lock directory for the sandbox uid pool (/run or TMPDIR)")


# What a uid's lock file says about the processes of that uid when nobody holds the lock.
# Both 5 bytes: each overwrites the other whole (a shorter marker over a longer one would
# leave a state that matches neither, and every later lease of that uid would scan /proc).
_CLEAN = b"clean"  # its last owner saw every process of the sandbox gone at release
_BUSY = b"busy!"   # leased; if found unlocked, its owner died or could not confirm it clean


@dataclass
class UidLease:
    uid: int
    _fd: int | None

    def release(self, *, clean: bool = False) -> None:
        """Unlock the uid; ``clean`` records that no process of it is left, so the next lease
        can skip the /proc scan (a full scan costs milliseconds per sandbox on a busy host)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                if clean:
                    os.pwrite(fd, _CLEAN, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


def lease_uid(base: int, size: int) -> UidLease:
    """Lease a uid no other sandbox (in any process on this host) is using.

    Blocking (a /proc scan and maybe a kill of leftovers from a crashed owner); call it
    from a worker thread. The uid need not exist in /etc/passwd.
    """
    directory = _lock_dir()
    start = random.randrange(size)
    for i in range(min(size, 4096)):
        uid = base + (start + i) % size
        fd = os.open(os.path.join(directory, f"{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        # A previous owner may have crashed without closing: nothing of it may survive. A
        # lock file never written (a uid no sandbox used) or marked clean needs no scan.
        state = os.pread(fd, len(_CLEAN), 0)
        os.pwrite(fd, _BUSY, 0)
        if state not in (b"", _CLEAN) and procscan.find_processes(uid=uid):
            procscan.kill_uid(uid)
            if procscan.find_processes(uid=uid):
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                continue
        return UidLease(uid, fd)
    raise SandboxError(f"no free sandbox uid in {base}..{base + size - 1}: too many live sandboxes")

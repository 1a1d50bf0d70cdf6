"""Per-sandbox scratch directories on the host."""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

ROOT_DIRS = ("/tmp", "/root", "/home")  # private per sandbox in the namespace tier
TMPFS = "tmpfs"  # scratch_root value: a memory-backed root when one is usable
TMPFS_DIR = "/dev/shm"
TMPFS_MIN_FREE = 1 << 30


def _mount_of(path: str) -> tuple[str, str, set[str]] | None:
    """(mount point, fs type, options) of the mount holding ``path``."""
    real = os.path.realpath(path)
    best: tuple[str, str, set[str]] | None = None
    try:
        with open("/proc/self/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        mnt = fields[1].replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and (best is None or len(mnt) >= len(best[0])):
            best = (mnt, fields[2], set(fields[3].split(",")))
    return best


def tmpfs_problem(path: str) -> str | None:
    """Why ``path`` cannot hold scratch dirs in memory, or ``None`` when it can."""
    mount = _mount_of(path)
    if not os.path.isdir(path) or mount is None:
        return f"{path} does not exist"
    if mount[1] != "tmpfs":
        return f"{path} is {mount[1]}, not tmpfs"
    if "noexec" in mount[2]:
        return f"{path} is mounted noexec (sandboxed programs written there could not run)"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable"
    st = os.statvfs(path)
    if st.f_bavail * st.f_frsize < TMPFS_MIN_FREE:
        return f"{path} has less than {TMPFS_MIN_FREE >> 30} GiB free"
    return None


def resolve_root(option: str | None) -> tuple[str, str | None]:
    """The scratch root for the ``scratch_root`` option and, for ``"tmpfs"`` that fell back
    to TMPDIR, why: ``None`` is TMPDIR, ``"tmpfs"`` is /dev/shm when it is a tmpfs that allows
    exec with at least 1 GiB free (file work and the per-command FIFOs then cost no disk
    journal), any other value is the path itself."""
    if option is None:
        return tempfile.gettempdir(), None
    if option != TMPFS:
        return option, None
    problem = tmpfs_problem(TMPFS_DIR)
    return (TMPFS_DIR, None) if problem is None else (tempfile.gettempdir(), problem)


def fs_dir(scratch: str, sandbox_path: str) -> str:
    return os.path.join(scratch, "fs", sandbox_path.strip("/"))


def make_scratch(root: str | None, sandbox_id: str, *, mapped: Iterable[str], ids: tuple[int, int] | None) -> str:
    """Create ``<root>/miles-<id>-<random suffix>`` with ``fs/<path>`` for every mapped sandbox path
    plus ``home``, ``tmp``, ``shm`` (the namespace's /dev/shm) and ``ctl`` (PID 1's command
    FIFOs); everything owned by the sandbox uid, mode 0700 at the top."""
    base = root or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f"miles-{sandbox_id}-", dir=base)
    made = [scratch]
    for sub in ("fs", "home", "tmp", "shm", "ctl", *(os.path.join("fs", p.strip("/")) for p in mapped)):
        path = os.path.join(scratch, sub)
        os.makedirs(path, exist_ok=True)
        made.append(path)
    for p in mapped:  # intermediate dirs of nested paths too
        cur = os.path.join(scratch, "fs")
        for part in p.strip("/").split("/"):
            cur = os.path.join(cur, part)
            made.append(cur)
    if ids is not None:
        for path in set(made):
            os.chown(path, *ids)
    os.chmod(scratch, 0o700)
    return scratch


LOCK_NAME = ".miles-owner.lock"


def hold(scratch: str) -> int:
    """Mark ``scratch`` as owned by this live process (released when the fd closes, also
    when the process dies): :func:`sweep_stale` removes only dirs nobody holds."""
    fd = os.open(os.path.join(scratch, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _unheld(path: str) -> bool:
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def sweep_stale(root: str | None, *, min_age_s: float = 60.0) -> list[str]:
    """Remove scratch dirs whose owning process died without closing its sandboxes (nobody
    holds their lock) and trash that was never purged. Returns what was removed."""
    base = root or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(("miles-sbx-", ".trash-miles-sbx-")):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not entry.is_dir(follow_symlinks=False) or now - st.st_mtime < min_age_s:
            continue
        if entry.name.startswith(".trash-") or _unheld(entry.path):
            remove_scratch(entry.path)
            if not os.path.exists(entry.path):
                removed.append(entry.path)
    return removed


def _force_writable(func, path, _exc) -> None:
    """rmtree error hook: sandbox code may leave dirs without write/exec permission."""
    try:
        parent = os.path.dirname(path)
        os.chmod(parent, os.stat(parent).st_mode | stat.S_IRWXU)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, os.stat(path).st_mode | stat.S_IRWXU)
        func(path)
    except OSError:
        pass


def remove_scratch(scratch: str) -> None:
    shutil.rmtree(scratch, onerror=_force_writable)
    if os.path.exists(scratch):  # second pass after permissions were fixed
        shutil.rmtree(scratch, ignore_errors=True)


def pristine(dirs: Iterable[str], ids: tuple[int, int] | None) -> bool:
    """Every dir is as :func:`wipe` leaves it: empty, mode 0755, owned by ``ids``."""
    try:
        for d in dirs:
            st = os.stat(d, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or stat.S_IMODE(st.st_mode) != 0o755:
                return False
            if ids is not None and (st.st_uid, st.st_gid) != ids:
                return False
            with os.scandir(d) as it:
                if next(it, None) is not None:
                    return False
    except OSError:
        return False
    return True


def wipe(dirs: Iterable[str], ids: tuple[int, int] | None, *, budget: int = 2000) -> bool:
    """Empty ``dirs`` in place (they are bind-mounted into a live namespace, so they cannot be
    swapped for fresh ones) and give them back their fresh owner and mode. Symlinks are
    removed, never followed. False when the dirs hold more than ``budget`` entries or one
    cannot be removed: the caller then discards the whole sandbox instead (fast rename +
    background delete) rather than spend the event loop's time here."""
    left = budget
    for top in dirs:
        stack = [top]
        doomed: list[tuple[str, bool]] = []
        while stack:
            d = stack.pop()
            try:
                with os.scandir(d) as it:
                    for e in it:
                        left -= 1
                        if left < 0:
                            return False
                        is_dir = e.is_dir(follow_symlinks=False)
                        doomed.append((e.path, is_dir))
                        if is_dir:
                            stack.append(e.path)
            except OSError:
                return False
        try:
            for path, is_dir in reversed(doomed):  # children before their parents
                if is_dir:
                    os.rmdir(path)
                else:
                    os.unlink(path)
            os.chmod(top, 0o755)
            if ids is not None:
                os.chown(top, *ids, follow_symlinks=False)
        except OSError:
            return False
    return True


def _mkdirs_owned(path: str, ids: tuple[int, int] | None) -> None:
    missing = []
    cur = path
    while not os.path.isdir(cur):
        missing.append(cur)
        cur = os.path.dirname(cur)
    for d in reversed(missing):
        os.mkdir(d, 0o755)
        if ids is not None:
            os.chown(d, *ids)


def seed(host_files: dict[str, bytes], host_dirs: Iterable[str], ids: tuple[int, int] | None) -> None:
    """Write initial files straight into a *fresh* scratch dir (no sandbox code has run
    yet, so nothing in it can be a planted symlink)."""
    for d in host_dirs:
        _mkdirs_owned(d, ids)
    for path, data in host_files.items():
        _mkdirs_owned(os.path.dirname(path), ids)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if ids is not None:
            os.chown(path, *ids)


_trash: set[str] = set()
_purger = ThreadPoolExecutor(max_workers=2, thread_name_prefix="miles-scratch-purge")


def discard(scratch: str) -> str:
    """Move a scratch dir out of the way (fast); remove it later with :func:`purge`."""
    trash = os.path.join(os.path.dirname(scratch), ".trash-" + os.path.basename(scratch))
    os.rename(scratch, trash)
    _trash.add(trash)
    return trash


_RM = shutil.which("rm", path="/usr/bin:/bin")


def purge(trash: str) -> None:
    # rm(1) deletes without holding the GIL the training driver needs (a Python rmtree of a
    # scratch dir per episode was ~10% of its samples); whatever it leaves (a non-root owner
    # facing mode-000 dirs) goes through remove_scratch, which fixes permissions.
    if _RM is not None:
        subprocess.run([_RM, "-rf", "--one-file-system", "--", trash], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=600)
    if os.path.lexists(trash):
        remove_scratch(trash)
    _trash.discard(trash)


def purge_executor() -> ThreadPoolExecutor:
    return _purger


def purge_later(trash: str) -> Future[None]:
    """Remove a discarded scratch dir in a background thread (joined at interpreter exit)."""
    return _purger.submit(purge, trash)


def _purge_all() -> None:
    for t in list(_trash):
        purge(t)


atexit.register(_purge_all)

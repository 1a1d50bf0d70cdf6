"""The namespace tier: a read-only view of the host with the task's paths mapped onto
scratch dirs, built by bubblewrap or (fallback) util-linux ``unshare`` + a mount script.

A sandbox is one long-lived namespace whose PID 1 (a bash loop reading a pipe we hold)
keeps it alive; every ``exec`` joins it with ``nsenter`` and drops all capabilities.
Killing PID 1 (or closing that pipe, e.g. when this process dies) makes the kernel kill
everything in it. Sandboxed code cannot kill PID 1, so ``kill -9 -1`` inside is harmless.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from miles_engine.errors import SandboxError
from miles_engine.sandbox.local import initscript, process

# Host top-level entries never shown: kernel/virtual trees, volatile state, user homes.
EXCLUDED_TOP = frozenset({"proc", "dev", "sys", "tmp", "run", "root", "home", "lost+found", "boot", "media", "mnt"})
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
READY = initscript.READY
INIT_SCRIPT = initscript.INIT_SCRIPT  # PID 1 of every sandbox namespace

Op = tuple[str, ...]  # ("ro", src, dst) | ("symlink", target, dst) | ("bind", src, dst) | ("tmpfs", dst)


@dataclass(frozen=True)
class Tools:
    launcher: Literal["bwrap", "unshare"]
    launcher_path: str
    nsenter: str
    setpriv: str
    env: str


def plan_mounts(mapped: Mapping[str, str], *, public_network: bool, hidden: Sequence[str] = (),
                ro_binds: Mapping[str, str] | None = None) -> list[Op]:
    """Mount operations, in order, for a root whose writable parts are ``mapped``
    (sandbox path -> host dir); everything else of the host is read-only or absent, plus the
    read-only ``ro_binds`` (sandbox path -> host path, e.g. a cache of agent binaries)."""
    mapped_tops = {p.strip("/").split("/")[0] for p in mapped}
    ops: list[Op] = []
    for name in sorted(os.listdir("/")):
        src = "/" + name
        if name in EXCLUDED_TOP or name in mapped_tops:
            continue
        if os.path.islink(src):
            ops.append(("symlink", os.readlink(src), src))
        elif os.path.isdir(src):
            ops.append(("ro", src, src))
    if public_network:  # e.g. /etc/resolv.conf -> /run/systemd/resolve/stub-resolv.conf
        real = os.path.realpath("/etc/resolv.conf")
        if real.startswith(("/run/", "/mnt/", "/media/")) and os.path.isfile(real):
            ops.append(("ro", real, real))
    for path, host in sorted((ro_binds or {}).items()):
        ops.append(("ro", host, path))
    if "home" not in mapped_tops:
        ops.append(("tmpfs", "/home"))
    for path in sorted(mapped, key=lambda p: p.count("/")):
        ops.append(("bind", mapped[path], path))
    for path in hidden:
        ops.append(("tmpfs", path))
    return ops


def bwrap_init_argv(tools: Tools, ops: Sequence[Op], *, unshare_net: bool, hostname: str,
                    shm_dir: str | None = None, ctl_dir: str | None = None) -> list[str]:
    """``shm_dir``: a host dir bound on /dev/shm, and /dev itself read-only, so every place the
    sandbox can write is a host dir (what a warm sandbox's reset wipes). ``ctl_dir``: bound
    read-only at :data:`initscript.CTL_DIR` (the FIFOs of commands PID 1 runs)."""
    argv = [
        tools.launcher_path,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--uid",
        "0",
        "--gid",
        "0",
        "--hostname",
        hostname,
        "--die-with-parent",
    ]
    if unshare_net:
        argv.append("--unshare-net")
    for op in ops:
        kind = op[0]
        if kind == "ro":
            argv += ["--ro-bind", op[1], op[2]]
        elif kind == "symlink":
            argv += ["--symlink", op[1], op[2]]
        elif kind == "bind":
            argv += ["--bind", op[1], op[2]]
        elif kind == "tmpfs":  # a hidden host dir: empty and read-only
            argv += ["--tmpfs", op[1], "--remount-ro", op[1]]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    if ctl_dir is not None:
        argv += ["--ro-bind", ctl_dir, initscript.CTL_DIR]
    if shm_dir is not None:
        argv += ["--bind", shm_dir, "/dev/shm", "--remount-ro", "/dev"]
    argv += [
        "--chdir",
        "/",
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/sbin:/usr/bin:/sbin:/bin",
        "--as-pid-1",
        "--",
        "/bin/bash",
        "-c",
        INIT_SCRIPT,
    ]
    return argv


# Runs as fake root in fresh user+mount+pid namespaces: builds the root on a tmpfs,
# pivots into it and becomes PID 1 (``INIT_SCRIPT``, passed in $MILES_INIT). Arguments: NEWROOT then ops (kind + args).
_UNSHARE_SCRIPT = r"""
set -eu
R=$1; shift
mount -t tmpfs -o mode=0755 miles-root "$R"
ro() { mount -o remount,bind,ro "$1" 2>/dev/null || mount -o remount,bind,ro,nosuid,nodev "$1" 2>/dev/null \
       || mount -o remount,bind,ro,nosuid,nodev,noexec "$1"; }
while [ $# -gt 0 ]; do
  case $1 in
    ro) if [ -d "$2" ]; then mkdir -p "$R$3"; else mkdir -p "$R$(dirname "$3")"; : > "$R$3"; fi
        mount --bind "$2" "$R$3"; ro "$R$3"; shift 3;;
    bind) mkdir -p "$R$3"; mount --bind "$2" "$R$3"; shift 3;;
    symlink) ln -s "$2" "$R$3"; shift 3;;
    tmpfs) mkdir -p "$R$2"; mount -t tmpfs -o mode=0755 tmpfs "$R$2"; shift 2;;
    *) echo "bad op $1" >&2; exit 2;;
  esac
done
mkdir -p "$R/proc" "$R/dev/pts" "$R/dev/shm"
mount -t proc proc "$R/proc"
mount -t tmpfs -o mode=0755 dev "$R/dev"
mkdir -p "$R/dev/pts" "$R/dev/shm"
mount -t tmpfs -o mode=1777 shm "$R/dev/shm"
for n in DEVNODES; do : > "$R/dev/$n"; mount --bind "/dev/$n" "$R/dev/$n"; done
ln -s /proc/self/fd "$R/dev/fd"; ln -s /proc/self/fd/0 "$R/dev/stdin"
ln -s /proc/self/fd/1 "$R/dev/stdout"; ln -s /proc/self/fd/2 "$R/dev/stderr"
cd "$R"; mkdir .old; pivot_root . .old; umount -l /.old; rmdir /.old
mount -o remount,bind,ro / 2>/dev/null || true
hostname HOSTNAME 2>/dev/null || true
exec /bin/bash -c "$MILES_INIT"
""".replace("DEVNODES", " ".join(DEV_NODES))


def unshare_init_argv(tools: Tools, ops: Sequence[Op], *, unshare_net: bool, new_root: str, hostname: str) -> list[str]:
    argv = [tools.launcher_path, "--user", "--map-root-user", "--pid", "--fork", "--mount", "--ipc", "--uts"]
    if unshare_net:
        argv.append("--net")
    script = _UNSHARE_SCRIPT.replace("HOSTNAME", hostname)
    argv += ["--", "/usr/bin/env", f"MILES_INIT={INIT_SCRIPT}", "/bin/sh", "-c", script, "miles-init", new_root]
    for op in ops:
        argv += list(op)
    return argv


# How nsenter reports a --wdns directory it cannot enter (it exits 1).
NSENTER_CWD_ERRORS = (b"nsenter: cannot open current working directory", b"nsenter: cannot change directory")


def as_cwd_error(raw: process.RawResult, cwd: str) -> process.RawResult:
    """nsenter's failure to enter ``cwd`` reported as a shell (and ``env -C``) would: 125."""
    if raw.exit_code != 1 or not raw.stderr.startswith(NSENTER_CWD_ERRORS):
        return raw
    reason = raw.stderr.decode(errors="replace").rsplit(":", 1)[-1].strip()
    msg = f"cannot change directory to '{cwd}': {reason}\n".encode()
    return process.RawResult(125, b"", msg, raw.timed_out, raw.truncated, raw.duration_s)


def exec_prefix(tools: Tools, init_pid: int, *, net: bool, cwd: str) -> list[str]:
    """argv prefix that runs a command inside the sandbox namespace of ``init_pid``,
    as (fake) root without capabilities, in ``cwd`` (nsenter's --wdns, not ``env -C``:
    one exec fewer per command, ~0.7 ms of CPU)."""
    argv = [tools.nsenter, "-t", str(init_pid), "-U", "-m", "-p", "-i", "-u"]
    if net:
        argv.append("-n")
    argv += [
        "-r",
        "--preserve-credentials",
        "-W",
        cwd,
        "--",
        tools.setpriv,
        "--bounding-set=-all",
        "--inh-caps=-all",
        "--no-new-privs",
        "--",
    ]
    return argv


def child_of(pid: int) -> int | None:
    """The single child of ``pid`` (PID 1 of the sandbox namespace)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = f.read().split()
        if kids:
            return int(kids[0])
    except OSError:
        pass
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        return int(name)
            except (OSError, ValueError, IndexError):
                continue
    return None


async def launch(
    tools: Tools,
    mapped: Mapping[str, str],
    *,
    scratch_dir: str,
    ids: tuple[int, int] | None,
    public_network: bool,
    hidden: Sequence[str],
    hostname: str,
    ro_binds: Mapping[str, str] | None = None,
    timeout_s: float,
    limits: process.Limits | None = None,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a sandbox namespace; returns the launcher (our child) and the namespace's PID 1.
    The launcher's stdin and stdout stay open (:func:`reset`); the caller closes them.

    On failure the launcher is killed (the caller reaps it) and :class:`SandboxError`
    carries the launcher's own error message.
    """
    ops = plan_mounts(mapped, public_network=public_network, hidden=hidden, ro_binds=ro_binds)
    if tools.launcher == "bwrap":
        shm_dir, ctl_dir = os.path.join(scratch_dir, "shm"), os.path.join(scratch_dir, "ctl")
        argv = bwrap_init_argv(tools, ops, unshare_net=not public_network, hostname=hostname,
                               shm_dir=shm_dir if os.path.isdir(shm_dir) else None,
                               ctl_dir=ctl_dir if os.path.isdir(ctl_dir) else None)
    else:
        new_root = os.path.join(scratch_dir, "root")
        os.makedirs(new_root, exist_ok=True)
        if ids:
            os.chown(new_root, *ids)
        argv = unshare_init_argv(tools, ops, unshare_net=not public_network, new_root=new_root, hostname=hostname)
    log_path = os.path.join(scratch_dir, "init.log")
    plan = process.spawn_plan(argv, limits or process.Limits(), ids, no_new_privs=False, die_with_parent=True)
    with open(log_path, "wb") as log:
        init = await asyncio.to_thread(
            subprocess.Popen,
            plan.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            start_new_session=True,
            close_fds=True,
            **plan.popen_kwargs,
        )
    assert init.stdout is not None
    line = await process.read_line(init.stdout, timeout_s)  # stdout stays open: reset answers on it
    pid1 = child_of(init.pid) if READY.encode() in line else None
    if pid1 is None:
        init.stdout.close()
        init.kill()
        await process.reap_popen(init, 5.0)
        with open(log_path, "rb") as f:
            detail = f.read()[-500:].decode(errors="replace").strip()
        raise SandboxError(f"could not start a {tools.launcher} sandbox: {detail or 'no output (timed out)'}")
    return init, pid1


def children(pid: int) -> list[int] | None:
    """Direct children of ``pid`` (zombies included); ``None`` if the kernel cannot say."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return None


async def wait_childless(pid1: int, deadline: float) -> bool:
    """Wait (until the loop time ``deadline``) for PID 1 to have no child left, zombies
    included: then no other process of its namespace exists (orphans are re-parented to
    PID 1, and nothing of a sandbox runs outside its PID namespace)."""
    loop = asyncio.get_running_loop()
    delay = 0.0005
    while True:
        kids = children(pid1)
        if kids is None:
            return False
        if not kids:
            return True
        if loop.time() > deadline:
            return False
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.02)

"""Warm reuse of namespace sandboxes: which sandbox may serve which spec, and the in-place
reset that makes a closed one as good as new (see ``LocalSandboxOptions.warm_pool_size``)."""

from __future__ import annotations

import asyncio
import os
import posixpath
import subprocess

from miles_engine.errors import SandboxError
from miles_engine.sandbox.local import initexec, namespace, procscan, scratch
from miles_engine.sandbox.protocol import SandboxSpec


def mapped_paths(spec: SandboxSpec) -> list[str]:
    """The sandbox paths a namespace maps onto writable scratch dirs for ``spec``."""
    paths: list[str] = []
    for p in (*spec.paths, *scratch.ROOT_DIRS):
        p = posixpath.normpath(p)
        if p == "/" or not p.startswith("/"):
            raise SandboxError(f"sandbox path '{p}' must be an absolute directory other than /")
        if not any(p == q or p.startswith(q + "/") for q in paths):
            paths.append(p)
    wd = posixpath.normpath(spec.workdir or "/")
    if wd != "/" and not any(wd == q or wd.startswith(q + "/") for q in paths) and not os.path.exists(wd):
        paths.append(wd)  # a workdir of its own (e.g. /workspace) becomes writable too
    return paths


def warm_key(spec: SandboxSpec) -> tuple[object, ...]:
    """What a warm sandbox must share with a spec to serve it: the namespace's writable
    mounts, its network and its memory limit (also PID 1's hard limit). Files, env and the
    workdir are applied per use."""
    return (tuple(sorted(mapped_paths(spec))), spec.network.mode == "public", spec.resources.memory_mb)


async def reset_in_place(init: subprocess.Popen[bytes], pid1: int, channel: initexec.InitChannel,
                         dirs: list[str], ids: tuple[int, int] | None, timeout_s: float) -> bool:
    """No process but PID 1, no IPC object, every writable dir in ``dirs`` empty with its
    fresh mode and owner. True only when all of it is confirmed (PID 1 answered our nonce
    and the kernel lists no child of it); False on any doubt."""
    if init.poll() is not None or not procscan.pid_alive(pid1) or namespace.children(pid1) is None:
        return False
    deadline = asyncio.get_running_loop().time() + timeout_s
    if not await channel.reset(timeout_s) or not await namespace.wait_childless(pid1, deadline):
        return False
    if scratch.pristine(dirs, ids):  # the common case: a few stats, not worth a thread hop
        return True
    return await asyncio.to_thread(scratch.wipe, dirs, ids)

"""Destroying a local sandbox: its processes killed and reaped, its scratch dir removed (or kept,
``keep_scratch``), its uid lease given back (marked unclean when anything was left)."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from miles_engine.sandbox.local import process, procscan, scratch

if TYPE_CHECKING:
    from miles_engine.sandbox.local.sandbox import LocalSandbox


async def destroy(sb: LocalSandbox) -> None:
    init = sb._init
    if sb._channel is not None:
        sb._channel.close()
    if init is not None:
        # Killing the namespace's PID 1 makes the kernel kill everything inside; the
        # launcher then reaps it and exits (so nothing is orphaned to the host init).
        if sb._pid1 and init.poll() is None:  # launcher alive: pid1 cannot have been recycled
            procscan.kill_pids([sb._pid1])
        for pipe in (init.stdin, init.stdout):
            if pipe is not None:
                pipe.close()
        await process.reap_popen(init, 3.0)
    if sb.namespaced and init is not None and init.returncode is not None and not procscan.pid_alive(sb._pid1):
        # PID 1 of the sandbox's PID namespace is gone, so the kernel has killed everything
        # in it, and nothing of the sandbox runs outside it: no /proc scan needed.
        sb.closed_leftovers = []
    else:
        sb.closed_leftovers = await asyncio.to_thread(
            procscan.reap_all,
            uid=sb.uid,
            sandbox_id=sb.id,
            extra_pids=[init.pid] if init is not None and init.returncode is None else [],
        )
    if init is not None and init.returncode is None:
        await process.reap_popen(init, 5.0)
    try:
        if sb.scratch and os.path.isdir(sb.scratch):
            if sb.opts.keep_scratch:  # hand it to root so the stale-scratch sweep leaves it alone
                if sb.ids:
                    os.chown(sb.scratch, os.geteuid(), os.getegid())
            else:
                trash = scratch.discard(sb.scratch)  # fast rename; the slow delete runs in the background
                sb.backend._purge(trash)
    except OSError:
        await asyncio.to_thread(scratch.remove_scratch, sb.scratch)
    finally:
        if sb._scratch_lock is not None:  # only now: an unheld scratch dir counts as stale
            os.close(sb._scratch_lock)
            sb._scratch_lock = None
        if sb.lease is not None:
            sb.lease.release(clean=not sb.closed_leftovers)
    sb.backend._forget(sb)

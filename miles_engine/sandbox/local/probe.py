"""Start-up probe: which isolation tier really works here (run it, never assume).

The probe starts a real namespace sandbox with the same code path sandboxes use, runs a
command in it and checks it can write its mapped ``/app`` and has no host network. The
result is cached per process and launcher choice.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import Literal

from miles_engine.sandbox.local import namespace, procscan, scratch, uidpool
from miles_engine.sandbox.local.namespace import Tools

_cache: dict[tuple[str, int], Probe] = {}
_lock = threading.Lock()
PROBE_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Probe:
    isolation: Literal["namespace", "process"]
    tools: Tools | None
    detail: str


def _which(name: str) -> str | None:
    for d in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
        path = os.path.join(d, name)
        if os.access(path, os.X_OK):
            return os.path.realpath(path) if d in ("/bin", "/sbin") else path
    found = shutil.which(name)
    return found if found and found.startswith("/usr/") else None  # must exist inside the sandbox root


def find_tools(launcher: Literal["bwrap", "unshare"]) -> Tools | str:
    paths = {n: _which(n) for n in (launcher, "nsenter", "setpriv", "env")}
    missing = [n for n, p in paths.items() if p is None]
    if missing:
        return f"{', '.join(missing)} not found under /usr"
    return Tools(launcher, paths[launcher], paths["nsenter"], paths["setpriv"], paths["env"])  # type: ignore[arg-type]


def _read_line(fd: int, timeout: float) -> bytes:
    data = b""
    while b"\n" not in data:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data


def try_namespace(tools: Tools, uid_base: int, uid_pool_size: int) -> str | None:
    """Start one namespace sandbox and run a command in it; ``None`` if it all worked,
    else a one-line reason."""
    lease = uidpool.lease_uid(uid_base, uid_pool_size) if os.geteuid() == 0 else None
    ids = (lease.uid, lease.uid) if lease else None
    kw = {"user": ids[0], "group": ids[1], "extra_groups": []} if ids else {}
    scr = scratch.make_scratch(None, "probe", mapped=["/app", "/tmp", "/root"], ids=ids)
    init = None
    try:
        mapped = {p: scratch.fs_dir(scr, p) for p in ("/app", "/tmp", "/root")}
        ops = namespace.plan_mounts(mapped, public_network=False)
        if tools.launcher == "bwrap":
            argv = namespace.bwrap_init_argv(tools, ops, unshare_net=True, hostname="miles-probe")
        else:
            os.makedirs(os.path.join(scr, "root"), exist_ok=True)
            if ids:
                os.chown(os.path.join(scr, "root"), *ids)
            argv = namespace.unshare_init_argv(
                tools, ops, unshare_net=True, new_root=os.path.join(scr, "root"), hostname="miles-probe"
            )
        init = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            start_new_session=True,
            **kw,
        )
        line = _read_line(init.stdout.fileno(), PROBE_TIMEOUT_S)  # type: ignore[union-attr]
        if namespace.READY.encode() not in line:
            init.kill()
            err = init.communicate(timeout=5)[1].decode(errors="replace").strip().splitlines()
            return f"{tools.launcher} could not start a sandbox: {err[-1] if err else 'no output'}"
        pid1 = namespace.child_of(init.pid)
        if pid1 is None:
            return f"{tools.launcher} started but its namespace init was not found"
        argv = namespace.exec_prefix(tools, pid1, net=True, cwd="/app") + [
            "/bin/sh",
            "-c",
            "echo ok > /app/p && cat /app/p && cat /proc/net/dev",
        ]
        res = subprocess.run(
            argv,
            capture_output=True,
            timeout=PROBE_TIMEOUT_S,
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,
            **kw,
        )
        out = res.stdout.decode(errors="replace")
        if res.returncode != 0 or not out.startswith("ok"):
            err = res.stderr.decode(errors="replace").strip()[-200:]
            return f"nsenter into the {tools.launcher} sandbox failed: {err}"
        ifaces = [ln.split(":")[0].strip() for ln in out.splitlines()[3:] if ":" in ln]
        if any(i != "lo" for i in ifaces):
            return f"{tools.launcher} sandbox still sees network interfaces {ifaces}"
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{tools.launcher} probe failed: {exc}"
    finally:
        if init is not None:
            pid1 = namespace.child_of(init.pid) if init.poll() is None else None
            if pid1:
                procscan.kill_pids([pid1], signal.SIGKILL)
            init.kill()
            init.communicate(timeout=5)
        if lease:
            procscan.reap_all(uid=lease.uid, sandbox_id="probe")
            lease.release()
        scratch.remove_scratch(scr)


def probe(namespace_tool: str = "auto", uid_base: int = 2_000_000, uid_pool_size: int = 65_536) -> Probe:
    """The best tier this host really provides (cached)."""
    key = (namespace_tool, os.geteuid())
    with _lock:
        if key in _cache:
            return _cache[key]
        launchers = ["bwrap", "unshare"] if namespace_tool == "auto" else [namespace_tool]
        reasons = []
        result = None
        for launcher in launchers:
            tools = find_tools(launcher)  # type: ignore[arg-type]
            if isinstance(tools, str):
                reasons.append(f"{launcher}: {tools}")
                continue
            why = try_namespace(tools, uid_base, uid_pool_size)
            if why is None:
                result = Probe("namespace", tools, f"namespaces via {launcher}")
                break
            reasons.append(why)
        if result is None:
            result = Probe("process", None, "no namespaces: " + "; ".join(reasons))
        _cache[key] = result
        return result

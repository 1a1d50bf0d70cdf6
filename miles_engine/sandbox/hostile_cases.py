"""The cases of the hostile-command suite (see :mod:`miles_engine.sandbox.hostile`)."""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from miles_engine.sandbox.protocol import SandboxBackend

SECRET_ENV = "MILES_TEST_SECRET_API_KEY"


@dataclass
class CaseResult:
    case: str
    contained: bool
    detail: str
    leftover_processes: int | None  # seen on this host after close; None if not observable
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Ctx:
    """What a case may use: a per-case token, the host-side fixtures, the backend."""

    backend: SandboxBackend
    token: str
    fixtures: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)


CaseFn = Callable[[Any, Ctx], Awaitable[tuple[bool, str]]]


@dataclass(frozen=True)
class HostileCase:
    name: str
    description: str
    run: CaseFn


def _host_pids_with(token: str) -> list[int]:
    """Host processes whose command line carries ``token`` (local backends only)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        with open(f"/proc/{name}/stat") as st:
                            if st.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                                found.append(int(name))
            except OSError:
                continue
    return [p for p in found if p != os.getpid()]


def _describe(backend: SandboxBackend) -> dict[str, Any]:
    fn = getattr(backend, "describe", None)
    return dict(fn()) if callable(fn) else {}


# How late a loaded host may answer: the cases test what a sandbox contains, not how fast the
# host is, so a wall-clock bound is only a safety stop against a command that was never killed.
SLOW_HOST_S = 20.0


# ------------------------------------------------------------------------------ cases
async def fork_bomb(sb: Any, ctx: Ctx) -> tuple[bool, str]:
    info = _describe(ctx.backend)
    if info and not info.get("max_processes_enforced", True):
        return (
            False,
            "not run: no per-sandbox process limit here (needs root or namespaces); a fork bomb would exhaust the host",
        )
    count = getattr(sb, "leftover_processes", None)
    peak = 0
    t = time.monotonic()
    task = asyncio.ensure_future(sb.exec(":(){ :|:& };:", timeout_s=3))
    while not task.done() or time.monotonic() - t < 2.0:  # watch it grow for a while
        if count is not None:
            peak = max(peak, len(await asyncio.to_thread(count)))
        await asyncio.sleep(0.2)
    r = await task
    t0 = time.monotonic()
    subprocess.run(["/bin/true"], timeout=10, check=False)
    host_ok = time.monotonic() - t0 < SLOW_HOST_S
    limit = getattr(getattr(ctx.backend, "options", None), "max_processes", None)
    bounded = count is None or limit is None or peak <= limit + 8
    took = time.monotonic() - t
    ok = bounded and host_ok and took < 15 + SLOW_HOST_S
    return ok, (
        f"peak {peak if count else '?'} processes (limit {limit}); exec returned "
        f"(exit {r.exit_code}, timed_out={r.timed_out}); host {'responsive' if host_ok else 'UNRESPONSIVE'}"
    )


async def network_tcp(sb: Any, ctx: Ctx) -> tuple[bool, str]:
    port, host_ip = ctx.fixtures["tcp_port"], ctx.fixtures["host_ip"]
    targets = [f"127.0.0.1/{port}", "1.1.1.1/53", "8.8.8.8/443"] + ([f"{host_ip}/{port}"] if host_ip else [])
    script = "; ".join(f"timeout 3 bash -c 'exec 3<>/dev/tcp/{t}' 2>/dev/null && echo OPEN {t}" for t in targets)
    r = await sb.exec(script, timeout_s=15)
    opened = [ln[5:] for ln in r.stdout.splitlines() if ln.startswith("OPEN ")]
    accepted = ctx.fixtures["tcp_accepted"]()
    ok = not opened and accepted == 0
    return ok, (
        f"connections out: {', '.join(opened) or 'none'}; host listener accepted {accepted}"
        + ("" if ok else " (network not isolated)")
    )


async def network_dns(sb: Any, ctx: Ctx) -> tuple[bool, str]:
    port, host_ip = ctx.fixtures["udp_port"], ctx.fixtures["host_ip"]
    query = r"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03com\x00\x00\x01\x00\x01"
    dests = ["127.0.0.1"] + ([host_ip] if host_ip else [])
    sends = "; ".join(f"printf '{query}' > /dev/udp/{d}/{port} 2>/dev/null" for d in dests)
    r = await sb.exec(f"{sends}; timeout 4 getent hosts example.com && echo RESOLVED", timeout_s=15)
    got = ctx.fixtures["udp_received"]()
    resolved = "RESOLVED" in r.stdout
    ok = got == 0 and not resolved
    return ok, (
        f"DNS-style datagrams reaching a host listener: {got}; public name resolved: {'yes' if resolved else 'no'}"
    )


async def write_outside(sb: Any, ctx: Ctx) -> tuple[bool, str]:
    name = f"miles-escape-{ctx.token}"
    targets = [f"/tmp/{name}", f"/var/tmp/{name}", f"/dev/shm/{name}", f"/etc/{name}", f"/usr/{name}", f"/{name}"]
    await sb.exec("; ".join(f"echo x > {t} 2>/dev/null" for t in targets), timeout_s=10)
    escaped = [t for t in targets if os.path.exists(t)]
    for t in escaped:
        try:
            os.unlink(t)
        except OSError:
            pass
    return not escaped, f"files created on the host: {', '.join(escaped) or 'none'} (tried {len(targets)} host paths)"


async def read_host_files(sb: Any, ctx: Ctx) -> tuple[bool, str]:
    secret_path, secret = ctx.fixtures["secret_file"], ctx.fixtures["secret_value"]
    r = await sb.exec(f"cat {secret_path}; cat /proc/1/root{secret_path}; cat /etc/shadow", timeout_s=10)
    leaks = []
    if secret in r.stdout:
        leaks.append(secret_path)
    shadow = ctx.fixtures.get("shadow_line")
    if shadow and shadow in r.stdout:
        leaks.append("/etc/shadow")
    return not leaks, f"host files read: {', '.join(leaks) or 'none'} (tried {secret_path}, /etc/shadow)"


async def env_secrets(sb: Any, ctx: Ctx) -> tuple[bool, str]:
    secret = ctx.fixtures["env_secret"]
    r = await sb.exec(
        "env; cat /proc/1/environ; cat /proc/$PPID/environ; for f in /proc/[0-9]*/environ; do cat $f; done 2>/dev/null",
        timeout_s=10,
    )
    leaked = secret in r.stdout or secret in r.stderr
    return (
        not leaked,
        f"parent secret {SECRET_ENV} {'VISIBLE' if leaked else 'not visible'} "
        "(env, /proc/1, /proc/$PPID, all /proc/*/environ)",
    )


async def output_flood(sb: Any, ctx: Ctx) -> tuple[bool, str]:
    cap = 1 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = await sb.exec("yes miles | head -c 100000000; printf '\\xff\\xfe' >&2", timeout_s=30, max_output_bytes=cap)
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    ok = r.truncated and len(r.stdout.encode()) <= cap + 64 and not r.timed_out and grew_mb < 64
    return ok, (
        f"100 MB written: kept {len(r.stdout)} chars, truncated={r.truncated}, {r.duration_s:.2f}s, "
        f"peak memory +{grew_mb:.0f} MiB"
    )


async def sleep_past_timeout(sb: Any, ctx: Ctx) -> tuple[bool, str]:
    r = await sb.exec(f"sleep 3000.{ctx.token}", timeout_s=1)
    ok = r.timed_out and r.exit_code is None and r.duration_s < 1 + SLOW_HOST_S
    return ok, f"timed_out={r.timed_out} exit_code={r.exit_code} after {r.duration_s:.2f}s"


async def daemon_left_behind(sb: Any, ctx: Ctx) -> tuple[bool, str]:
    tok = ctx.token
    t = time.monotonic()
    r = await sb.exec(
        f"setsid sleep 3000.{tok}1 </dev/null >/dev/null 2>&1 & "
        f"( (setsid sleep 3000.{tok}2 </dev/null >/dev/null 2>&1 &) & ); "
        f"nohup setsid sleep 3000.{tok}3 & "  # keeps our stdout pipe open
        f"setsid env -i sleep 3000.{tok}4 </dev/null >/dev/null 2>&1 & echo spawned",
        timeout_s=10,
    )
    took = time.monotonic() - t
    inside = await sb.exec(
        f"cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' | grep -c '^3000[.]{tok}[1-4]$'", timeout_s=10
    )
    started = inside.stdout.strip()
    ok = not r.timed_out  # exec waited for none of the daemons (each sleeps past its timeout)
    return ok, f"exec returned in {took:.1f}s with {started or '?'} of 4 daemons running; all must be gone after close"


async def disk_fill(sb: Any, ctx: Ctx) -> tuple[bool, str]:
    r = await sb.exec("head -c 1G /dev/zero > big.bin; echo rc=$?; stat -c %s big.bin; rm -f big.bin", timeout_s=30)
    lines = r.stdout.split()
    size = int(lines[-1]) if lines and lines[-1].isdigit() else -1
    ok = 0 <= size < (1 << 30) and not r.timed_out
    limit = getattr(getattr(ctx.backend, "options", None), "max_file_size_mb", None)
    return ok, (
        f"1 GiB write stopped at {size / (1 << 20):.0f} MiB (file size limit {limit} MiB; "
        f"a per-file cap, not a disk quota)"
    )


async def sigterm_ignoring_tree(sb: Any, ctx: Ctx) -> tuple[bool, str]:
    tok = ctx.token
    r = await sb.exec(
        f"trap '' TERM; for i in 1 2 3; do (trap '' TERM; exec sleep 3000.{tok}) & done; sleep 3000.{tok}", timeout_s=1
    )
    await asyncio.sleep(0.2)
    check = await sb.exec(
        f"cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' | grep -c '^3000[.]{tok}$'", timeout_s=10
    )
    alive_inside = int(check.stdout.strip() or 0)
    alive_host = len(_host_pids_with(f"3000.{tok}"))
    ok = r.timed_out and r.duration_s < 1 + SLOW_HOST_S and alive_inside == 0 and alive_host == 0
    return ok, (
        f"timed out after {r.duration_s:.2f}s; {max(alive_inside, alive_host)} of 4 TERM-ignoring processes "
        f"left after the timeout kill"
    )


async def binary_output(sb: Any, ctx: Ctx) -> tuple[bool, str]:
    r = await sb.exec("head -c 65536 /dev/urandom; head -c 4096 /dev/urandom >&2", timeout_s=10)
    ok = isinstance(r.stdout, str) and r.exit_code == 0 and len(r.stdout) > 0
    return ok, f"binary junk decoded with replacement ({len(r.stdout)} chars stdout, {len(r.stderr)} stderr)"


CASES: tuple[HostileCase, ...] = (
    HostileCase("fork_bomb", "a shell fork bomb", fork_bomb),
    HostileCase("network_tcp", "outbound TCP to the host and the internet", network_tcp),
    HostileCase("network_dns", "DNS: datagrams to a host listener and a public lookup", network_dns),
    HostileCase("write_outside", "writing files into host directories", write_outside),
    HostileCase("read_host_files", "reading a host secret file and /etc/shadow", read_host_files),
    HostileCase("env_secrets", "reading the parent's environment secrets", env_secrets),
    HostileCase("output_flood", "100 MB of output", output_flood),
    HostileCase("sleep_past_timeout", "sleeping past the timeout", sleep_past_timeout),
    HostileCase("daemon_left_behind", "setsid / double-fork daemons left behind", daemon_left_behind),
    HostileCase("disk_fill", "filling the disk past the file-size limit", disk_fill),
    HostileCase("sigterm_ignoring_tree", "a process tree that ignores SIGTERM", sigterm_ignoring_tree),
    HostileCase("binary_output", "binary junk on stdout/stderr", binary_output),
)
CASE_NAMES = tuple(c.name for c in CASES)

"""The hostile-command suite: does a sandbox backend contain what a task might do?

Reusable for any :class:`~miles_engine.sandbox.protocol.SandboxBackend`. Each case runs
in a fresh sandbox with short timeouts and reports ``contained`` with a one-line detail.
After each case the sandbox is closed and the host's /proc is checked: a process of the
sandbox (or one carrying the case's unique token) still alive makes the case fail.
Nothing is assumed: on a backend that cannot block the network, the network cases
honestly report "not contained".
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from miles_engine.sandbox.protocol import NetworkPolicy, SandboxBackend, SandboxSpec
from miles_engine.sandbox.hostile_cases import (  # noqa: F401  (re-exported)
    CASE_NAMES,
    CASES,
    SECRET_ENV,
    CaseResult,
    Ctx,
    HostileCase,
    _host_pids_with,
)


# ------------------------------------------------------------------------------ runner
def _host_ip() -> str | None:
    """A non-loopback address of this host (from its own name; no packet is sent anywhere)."""
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


class _Fixtures:
    """Host-side bait: TCP and UDP listeners, a world-readable secret file, an env secret."""

    async def __aenter__(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        self.tcp_count = 0
        self.udp_count = 0

        def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.tcp_count += 1
            writer.close()

        fixtures = self

        class _Udp(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: Any) -> None:
                fixtures.udp_count += 1

        self.server = await asyncio.start_server(on_conn, "0.0.0.0", 0)
        self.udp, _ = await loop.create_datagram_endpoint(_Udp, local_addr=("0.0.0.0", 0))
        token = secrets.token_hex(8)
        self.secret_file = f"/tmp/miles-secret-{token}"
        with open(self.secret_file, "w") as f:
            f.write(f"miles-host-secret-{token}\n")
        os.chmod(self.secret_file, 0o644)  # readable by anyone: only isolation can hide it
        self.saved_env = os.environ.get(SECRET_ENV)
        env_secret = "sk-miles-" + secrets.token_hex(12)
        os.environ[SECRET_ENV] = env_secret
        shadow = None
        try:
            with open("/etc/shadow") as f:
                shadow = f.readline().strip() or None
        except OSError:
            pass
        return {
            "tcp_port": self.server.sockets[0].getsockname()[1],
            "udp_port": self.udp.get_extra_info("sockname")[1],
            "tcp_accepted": lambda: self.tcp_count,
            "udp_received": lambda: self.udp_count,
            "host_ip": _host_ip(),
            "secret_file": self.secret_file,
            "secret_value": f"miles-host-secret-{token}",
            "env_secret": env_secret,
            "shadow_line": shadow,
        }

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        self.udp.close()
        try:
            os.unlink(self.secret_file)
        except OSError:
            pass
        if self.saved_env is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = self.saved_env


def default_spec(backend: SandboxBackend) -> SandboxSpec:
    """The strictest spec the backend supports (network off when it can do that)."""
    caps = backend.capabilities()
    net = "none" if "none" in caps.network_modes else sorted(caps.network_modes)[0]
    kw: dict[str, Any] = {"network": NetworkPolicy(mode=net)}  # type: ignore[arg-type]
    if not caps.absolute_paths:
        kw["paths"] = ()
    return SandboxSpec(**kw)


async def _run_case(
    backend: SandboxBackend, case: HostileCase, spec: SandboxSpec, fixtures: dict[str, Any], case_timeout_s: float
) -> CaseResult:
    token = f"{secrets.randbelow(10**6):06d}"
    ctx = Ctx(backend, token, fixtures)
    start = time.monotonic()
    try:
        sb = await backend.create(spec)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return CaseResult(case.name, False, f"could not create a sandbox: {exc}", None, time.monotonic() - start)
    try:
        contained, detail = await asyncio.wait_for(case.run(sb, ctx), case_timeout_s)
    except TimeoutError:
        contained, detail = False, f"the case did not finish within {case_timeout_s:.0f}s"
    except Exception as exc:  # noqa: BLE001
        contained, detail = False, f"{type(exc).__name__}: {exc}"
    finally:
        try:
            await asyncio.wait_for(sb.close(), 30)
        except Exception as exc:  # noqa: BLE001
            contained, detail = False, f"close failed: {type(exc).__name__}: {exc}"
    await asyncio.sleep(0.05)
    tagged = _host_pids_with(f"3000.{token}")
    own = sb.leftover_processes() if hasattr(sb, "leftover_processes") else None
    leftovers = None if own is None and not tagged else len(own or []) + len(tagged)
    if leftovers:
        contained = False
        detail += f"; {leftovers} process(es) survived close"
        for pid in tagged + [p.pid for p in own or []]:  # do not leave our own mess behind
            try:
                os.kill(pid, 9)
            except OSError:
                pass
    return CaseResult(case.name, contained, detail, leftovers, round(time.monotonic() - start, 3))


async def run_hostile_suite(
    backend: SandboxBackend,
    *,
    cases: Sequence[str] | None = None,
    spec: SandboxSpec | None = None,
    concurrency: int = 4,
    case_timeout_s: float = 60.0,
    on_result: Callable[[CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Run the hostile cases (all, or those named) against ``backend``; results in case order."""
    unknown = sorted(set(cases or ()) - set(CASE_NAMES))
    if unknown:
        raise ValueError(f"unknown hostile case(s) {', '.join(unknown)}; available: {', '.join(CASE_NAMES)}")
    chosen = [c for c in CASES if cases is None or c.name in cases]
    base = spec or default_spec(backend)
    sem = asyncio.Semaphore(max(1, concurrency))
    async with _Fixtures() as fixtures:

        async def one(case: HostileCase) -> CaseResult:
            async with sem:
                res = await _run_case(backend, case, base, fixtures, case_timeout_s)
            if on_result is not None:
                on_result(res)
            return res

        return list(await asyncio.gather(*(one(c) for c in chosen)))

"""Lifecycle at scale: a cap on live containers, a creation-rate limit, the owner label that
lets the next start sweep a killed process's containers, and per-step latency metrics."""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import time
from collections import deque
from collections.abc import Iterable

OWNER_LABEL = "miles.owner"  # host:pid:start-time of the process that created the container


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22 of /proc/PID/stat), None if it is gone."""
    try:
        stat = open(f"/proc/{pid}/stat", encoding="ascii", errors="replace").read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def owner_id() -> str:
    """This process as ``host:pid:start`` (start time guards against a reused pid)."""
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_time(pid) or '?'}"


def owner_is_dead(owner: str) -> bool:
    """True when ``owner`` names a process of *this* host that no longer runs. Owners on
    other hosts, or labels we cannot read, are never judged dead."""
    host, _, rest = owner.partition(":")
    pid_s, _, start = rest.partition(":")
    if host != socket.gethostname() or not pid_s.isdigit() or not start or start == "?":
        return False
    return _start_time(int(pid_s)) != start


class Limiter:
    """At most ``max_live`` holders at once, and starts spaced ``1/rate`` seconds apart."""

    def __init__(self, max_live: int | None, rate_per_s: float | None) -> None:
        self.max_live = max_live
        self.interval = 1.0 / rate_per_s if rate_per_s else 0.0
        self._sem: asyncio.Semaphore | None = None
        self._next = 0.0
        self._lock: asyncio.Lock | None = None

    async def acquire(self) -> None:
        if self.max_live:
            if self._sem is None:
                self._sem = asyncio.Semaphore(self.max_live)
            await self._sem.acquire()

    def release(self) -> None:
        if self._sem is not None:
            self._sem.release()

    async def pace(self) -> None:
        """Wait for this start's turn under the rate limit."""
        if not self.interval:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            now = time.monotonic()
            wait = self._next - now
            self._next = max(now, self._next) + self.interval
        if wait > 0:
            await asyncio.sleep(wait)


class StepMetrics:
    """Latencies of create / exec / destroy (the last 10k of each) and image counters."""

    def __init__(self) -> None:
        self.latency: dict[str, deque[float]] = {k: deque(maxlen=10_000) for k in ("create", "exec", "destroy")}
        self.counts: dict[str, int] = {}
        self._recent: dict[str, deque[float]] = {k: deque(maxlen=10_000) for k in self.latency}
        self._counts_logged: dict[str, int] = {}

    def observe(self, step: str, seconds: float) -> None:
        self.latency[step].append(seconds)
        self._recent[step].append(seconds)

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def window(self) -> dict[str, float]:
        """What happened since the last call (one training step's worth): ``sandbox/<step>_p50_s``,
        ``_p95_s`` and ``_n`` of the latencies observed since, and each counter's increase
        (``sandbox/builds``, ``sandbox/build_cache_hits``, ``sandbox/images_stood_in``, 0 when none)."""
        out: dict[str, float] = {}
        for step, recent in self._recent.items():
            values = list(recent)
            recent.clear()
            out[f"sandbox/{step}_n"] = float(len(values))
            if values:
                out[f"sandbox/{step}_p50_s"], out[f"sandbox/{step}_p95_s"] = _quantiles(values)
        for key in sorted({"builds", "build_cache_hits", "images_stood_in", *self.counts}):
            now = self.counts.get(key, 0)
            out[f"sandbox/{key}"] = float(now - self._counts_logged.get(key, 0))
            self._counts_logged[key] = now
        return out

    def snapshot(self) -> dict[str, float]:
        """Flat metrics: ``sandbox/<step>_p50_s``, ``_p95_s``, ``_n`` and the counters."""
        out: dict[str, float] = {}
        for step, values in self.latency.items():
            if values:
                p50, p95 = _quantiles(values)
                out |= {f"sandbox/{step}_p50_s": p50, f"sandbox/{step}_p95_s": p95, f"sandbox/{step}_n": len(values)}
        out |= {f"sandbox/{k}": float(v) for k, v in sorted(self.counts.items())}
        return out


def _quantiles(values: Iterable[float]) -> tuple[float, float]:
    data = sorted(values)
    if len(data) == 1:
        return data[0], data[0]
    q = statistics.quantiles(data, n=20, method="inclusive")
    return statistics.median(data), q[18]

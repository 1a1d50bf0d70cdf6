"""Local sandbox figures: create+exec(true)+close latency per isolation tier, and 64
concurrent sandboxes each running a 1 s command.

    .venv/bin/python bench/sandbox_bench.py [--n 100] [--concurrent 64]

Prints a table; not a test. Tiers are measured interleaved (one cycle of each in turn)
so background load on a shared box hits them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from miles_engine.sandbox.local.backend import LocalSandboxBackend
from miles_engine.sandbox.local.options import LocalSandboxOptions
from miles_engine.sandbox.local.probe import probe
from miles_engine.sandbox.local.procscan import find_processes
from miles_engine.sandbox.protocol import NetworkPolicy, SandboxSpec


def spec_for(tier: str) -> SandboxSpec:
    return SandboxSpec() if tier == "namespace" else SandboxSpec(paths=(), network=NetworkPolicy(mode="public"))


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


async def cycle(be: LocalSandboxBackend, spec: SandboxSpec) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    sb = await be.create(spec)
    t1 = time.perf_counter()
    r = await sb.exec("true")
    t2 = time.perf_counter()
    await sb.close()
    t3 = time.perf_counter()
    assert r.exit_code == 0, r
    return t1 - t0, t2 - t1, t3 - t2


async def latency(backends: dict[str, LocalSandboxBackend], n: int) -> dict[str, list[tuple[float, float, float]]]:
    out: dict[str, list[tuple[float, float, float]]] = {t: [] for t in backends}
    for t, be in backends.items():  # warm-up
        await cycle(be, spec_for(t))
    for _ in range(n):
        for t, be in backends.items():
            out[t].append(await cycle(be, spec_for(t)))
    return out


async def concurrent(be: LocalSandboxBackend, tier: str, k: int) -> tuple[float, int, int, float]:
    spec = spec_for(tier)
    cpu0 = os.times()

    async def one():
        async with await be.create(spec) as sb:
            r = await sb.exec("sleep 1")
            return r, sb

    t = time.perf_counter()
    done = await asyncio.gather(*(one() for _ in range(k)))
    wall = time.perf_counter() - t
    await be.aclose()
    cpu1 = os.times()
    left = sum(len(find_processes(uid=sb.uid, sandbox_id=sb.id)) for _, sb in done)
    ok = sum(r.exit_code == 0 for r, _ in done)
    cpu = (cpu1.user + cpu1.system + cpu1.children_user + cpu1.children_system) - (
        cpu0.user + cpu0.system + cpu0.children_user + cpu0.children_system
    )
    return wall, left, ok, cpu


async def main(n: int, k: int) -> None:
    p = probe()
    tiers = ["namespace", "process"] if p.isolation == "namespace" else ["process"]
    backends = {t: LocalSandboxBackend(LocalSandboxOptions(isolation=t)) for t in tiers}
    print(f"host: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; euid {os.geteuid()}; probe: {p.detail}")
    print(f"\ncreate + exec(true) + close, N={n} per tier, interleaved (ms)")
    print(f"{'tier':<10} {'p50':>7} {'p99':>7} {'mean':>7} | {'create p50':>10} {'exec p50':>9} {'close p50':>10}")
    for t, rows in (await latency(backends, n)).items():
        tot = [1e3 * sum(r) for r in rows]
        parts = [[1e3 * r[i] for r in rows] for i in range(3)]
        print(
            f"{t:<10} {pct(tot, 50):7.1f} {pct(tot, 99):7.1f} {statistics.mean(tot):7.1f} | "
            f"{pct(parts[0], 50):10.1f} {pct(parts[1], 50):9.1f} {pct(parts[2], 50):10.1f}"
        )
    print(f"\n{k} concurrent sandboxes, each create + exec('sleep 1') + close")
    print(f"{'tier':<10} {'wall s':>7} {'ok':>5} {'leftover procs':>15} {'cpu s':>7}")
    for t, be in backends.items():
        wall, left, ok, cpu = await concurrent(be, t, k)
        print(f"{t:<10} {wall:7.2f} {ok:>5} {left:>15} {cpu:7.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--concurrent", type=int, default=64)
    a = ap.parse_args()
    asyncio.run(main(a.n, a.concurrent))

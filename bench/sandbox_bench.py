"""Local sandbox figures: create+exec(true)+close latency and CPU per variant, and 64
concurrent sandboxes each running a 1 s command.

    .venv/bin/python bench/sandbox_bench.py [--n 100] [--concurrent 64] [--docker]

``--docker`` adds the docker backend's figures (bench/docker_bench.py, which also runs alone:
stand-in family build times cold / cached, create+exec+destroy p50/p95 on the default and a
stood-in image, episodes/s of 16 concurrent oracle episodes of Dockerfile-built Harbor and
terminal-bench tasks) on the engine DOCKER_HOST names (``eval "$(scripts/container_engine.sh start)"``).

Variants (namespace ones only where the kernel gives namespaces): ``namespace`` (commands
forked by the sandbox's PID 1, the default), ``ns-nsenter`` (``exec_via_init: false``: each
command joins the namespace through prlimit/setpriv/nsenter from the host), ``ns-warm``
(``warm_pool_size: 4``: close resets the sandbox in place, create reuses it), ``process``.
CPU per cycle is the whole machine's busy time over the variant's cycles / N (it includes
the namespace's own processes, which are not our children, and the kernel's work; other
load on the box adds noise alike to every variant). Variants are measured interleaved (one
cycle of each in turn) so background load hits them alike.
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
    return SandboxSpec(paths=(), network=NetworkPolicy(mode="public")) if tier == "process" else SandboxSpec()


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


VARIANTS = {
    "namespace": {"isolation": "namespace"},
    "ns-nsenter": {"isolation": "namespace", "exec_via_init": False},
    "ns-warm": {"isolation": "namespace", "warm_pool_size": 4},
    "process": {"isolation": "process"},
}


def busy_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (user+nice+system+irq+softirq+steal)."""
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    return (sum(cpu[:8]) - cpu[3] - cpu[4]) / os.sysconf("SC_CLK_TCK")


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


async def latency(backends: dict[str, LocalSandboxBackend], n: int
                  ) -> tuple[dict[str, list[tuple[float, float, float]]], dict[str, float]]:
    out: dict[str, list[tuple[float, float, float]]] = {t: [] for t in backends}
    busy = dict.fromkeys(backends, 0.0)
    for t, be in backends.items():  # warm-up
        await cycle(be, spec_for(t))
    for _ in range(n):
        for t, be in backends.items():
            b0 = busy_seconds()
            out[t].append(await cycle(be, spec_for(t)))
            await asyncio.sleep(0.01)  # let the background scratch purge of a destroyed sandbox land here
            busy[t] += busy_seconds() - b0
    return out, {t: v / n for t, v in busy.items()}


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
    tiers = list(VARIANTS) if p.isolation == "namespace" else ["process"]
    if p.tools is None or p.tools.launcher != "bwrap":  # PID 1 exec and the warm pool are bwrap-only
        tiers = [t for t in tiers if t not in ("ns-nsenter", "ns-warm")]
    backends = {t: LocalSandboxBackend(LocalSandboxOptions(**VARIANTS[t])) for t in tiers}
    print(f"host: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; euid {os.geteuid()}; probe: {p.detail}")
    print(f"\ncreate + exec(true) + close, N={n} per variant, interleaved (ms; cpu = machine busy ms per cycle)")
    print(f"{'variant':<11} {'p50':>7} {'p99':>7} {'mean':>7} | {'create p50':>10} {'exec p50':>9} {'close p50':>10}"
          f" | {'cpu':>6}")
    rows_by, cpu_by = await latency(backends, n)
    for t, rows in rows_by.items():
        tot = [1e3 * sum(r) for r in rows]
        parts = [[1e3 * r[i] for r in rows] for i in range(3)]
        print(
            f"{t:<11} {pct(tot, 50):7.1f} {pct(tot, 99):7.1f} {statistics.mean(tot):7.1f} | "
            f"{pct(parts[0], 50):10.1f} {pct(parts[1], 50):9.1f} {pct(parts[2], 50):10.1f} | {1e3 * cpu_by[t]:6.1f}"
        )
    print(f"\n{k} concurrent sandboxes, each create + exec('sleep 1') + close")
    print(f"{'variant':<11} {'wall s':>7} {'ok':>5} {'leftover procs':>15} {'cpu s':>7}")
    for t, be in backends.items():
        wall, left, ok, cpu = await concurrent(be, t, k)
        print(f"{t:<11} {wall:7.2f} {ok:>5} {left:>15} {cpu:7.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--concurrent", type=int, default=64)
    ap.add_argument("--docker", action="store_true", help="also measure the docker backend (bench/docker_bench.py)")
    ap.add_argument("--docker-n", type=int, default=30)
    ap.add_argument("--episodes", type=int, default=16)
    a = ap.parse_args()
    asyncio.run(main(a.n, a.concurrent))
    if a.docker:
        import docker_bench  # the bench/ directory is on sys.path when this script runs

        asyncio.run(docker_bench.main(a.docker_n, a.episodes))

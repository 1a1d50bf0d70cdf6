"""Docker sandbox figures (run through ``bench/sandbox_bench.py --docker``, or alone):
create+exec(true)+destroy latency p50/p95 with its parts, and episodes/s of K concurrent oracle
episodes of a task built from its Dockerfile (the Harbor fixture task, through the image map).

    eval "$(scripts/container_engine.sh start)"
    .venv/bin/python bench/docker_bench.py [--n 30] [--episodes 16]

The task image is built before timing (its build is cached by content hash; the first run on
a fresh engine builds it once). Episodes use the oracle agent and the task's own verifier.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

from miles_engine.hub import Hub
from miles_engine.rollout.episode import run_episode
from miles_engine.sandbox.protocol import SandboxSpec
from miles_sandbox_docker.backend import DockerSandboxBackend
from miles_sandbox_docker.options import DockerSandboxOptions

TASKS = Path(__file__).resolve().parents[1] / "plugins/sandboxes/docker/tests/tasks/harbor"


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


async def latency(be: DockerSandboxBackend, n: int) -> list[tuple[float, float, float]]:
    rows = []
    for i in range(n + 1):
        t0 = time.perf_counter()
        sb = await be.create(SandboxSpec())
        t1 = time.perf_counter()
        r = await sb.exec("true")
        t2 = time.perf_counter()
        await sb.close()
        t3 = time.perf_counter()
        assert r.exit_code == 0, r
        if i:  # the first one is a warm-up
            rows.append((t1 - t0, t2 - t1, t3 - t2))
    return rows


async def episodes(be: DockerSandboxBackend, k: int) -> tuple[float, int, float]:
    hub = Hub()
    source = hub.create("environment", "harbor", {"path": str(TASKS)}, where="harbor")
    task_id = "reverse-lines"
    await be.image_for(source.load_task(task_id).sandbox_spec(), be.run_id or "bench")  # build outside the timing
    agent = hub.create("agent", "oracle", {}, where="agent")
    t = time.perf_counter()
    results = await asyncio.gather(*(run_episode(source.load_task(task_id), agent, be) for _ in range(k)))
    wall = time.perf_counter() - t
    scores = [r.reward.reward for r in results]
    return wall, sum(s == 1.0 for s in scores), statistics.mean(s or 0.0 for s in scores)


async def main(n: int, k: int) -> None:
    be = DockerSandboxBackend(DockerSandboxOptions(run_id=f"bench-{os.getpid()}"))
    version = await be.ping()
    print(f"\ndocker backend: engine {version} via {be.cli.engine_name()} CLI {be.cli.executable()}; "
          f"host {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    try:
        rows = await latency(be, n)
        tot = [1e3 * sum(r) for r in rows]
        parts = [[1e3 * r[i] for r in rows] for i in range(3)]
        print(f"create + exec(true) + destroy, N={n} (ms)")
        print(f"{'backend':<9} {'p50':>7} {'p95':>7} | {'create p50':>10} {'exec p50':>9} {'exec p95':>9} {'destroy p50':>11}")
        print(f"{'docker':<9} {pct(tot, 50):7.0f} {pct(tot, 95):7.0f} | {pct(parts[0], 50):10.0f} "
              f"{pct(parts[1], 50):9.0f} {pct(parts[1], 95):9.0f} {pct(parts[2], 50):11.0f}")
        wall, solved, mean = await episodes(be, k)
        print(f"\n{k} concurrent oracle episodes of the Harbor task {TASKS / 'reverse-lines'} "
              f"(image built from its Dockerfile)")
        print(f"{'wall s':>7} {'episodes/s':>11} {'reward 1.0':>11} {'mean':>6}")
        print(f"{wall:7.2f} {k / wall:11.2f} {solved:>11} {mean:6.2f}")
        stats = be.stats()
        print("backend metrics: " + ", ".join(f"{k.removeprefix('sandbox/')}={v:.3g}" for k, v in stats.items()))
    finally:
        await be.aclose()
        await be.sweep(be.run_id or "")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--episodes", type=int, default=16)
    a = ap.parse_args()
    asyncio.run(main(a.n, a.episodes))

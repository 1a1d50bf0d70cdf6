"""Docker sandbox figures (run through ``bench/sandbox_bench.py --docker``, or alone): build
time of each stand-in family (cold: ``--no-cache`` under a throwaway tag, removed after; cached:
the backend's look-up of the already built family), create+exec(true)+destroy latency p50/p95
with its parts (the default image and a stood-in ``python:3.12-slim``), and episodes/s of K
concurrent oracle episodes of a task built from its Dockerfile (the Harbor fixture task).

    eval "$(scripts/container_engine.sh start)"
    .venv/bin/python bench/docker_bench.py [--n 30] [--episodes 16] [--families python,tb-python] [--no-cold]

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
from miles_sandbox_docker.standins import FAMILIES

TASKS = Path(__file__).resolve().parents[1] / "plugins/sandboxes/docker/tests/tasks"
# (environment, task): a Harbor task FROM ubuntu:24.04 (the base image through the exact map) and a
# terminal-bench task FROM terminal-bench's Python base (no registry here: the tb-python stand-in)
EPISODE_TASKS = (("harbor", "reverse-lines"), ("terminal-bench", "pip-on-tb-base"))


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


async def family_builds(be: DockerSandboxBackend, families: list[str], cold: bool) -> list[tuple[str, float, float]]:
    """(family, cold build s or nan, cached look-up s) per family."""
    o, rows = be.options, []
    for family in families:
        tag = await be.stand_ins.family_image(family)  # built once (outside the cold timing) if missing
        t = time.perf_counter()
        assert await be.stand_ins.family_image(family) == tag
        cached = time.perf_counter() - t
        cold_s = float("nan")
        if cold:
            throwaway = f"miles-bench-standin-{family}:{os.getpid()}"
            dockerfile = be.stand_ins.map.dockerfile(family, o.stand_in_base)
            net = ["--network", o.build_network] if o.build_network != "default" else []
            t = time.perf_counter()
            res = await be.cli.run(["build", "--no-cache", "--force-rm", "--tag", throwaway, *net, "-"],
                                   what=f"cold build of {family}", stdin=dockerfile.encode(),
                                   timeout_s=o.build_timeout_s, check=False)
            cold_s = time.perf_counter() - t
            await be.cli.run(["rmi", throwaway], what=f"remove {throwaway}", check=False)
            if res.rc != 0:
                raise SystemExit(f"cold build of {family} failed: {res.err[-500:]}")
        rows.append((family, cold_s, cached))
    return rows


async def latency(be: DockerSandboxBackend, n: int, image: str | None = None) -> list[tuple[float, float, float]]:
    rows = []
    for i in range(n + 1):
        t0 = time.perf_counter()
        sb = await be.create(SandboxSpec(image=image))
        t1 = time.perf_counter()
        r = await sb.exec("true")
        t2 = time.perf_counter()
        await sb.close()
        t3 = time.perf_counter()
        assert r.exit_code == 0, r
        if i:  # the first one is a warm-up
            rows.append((t1 - t0, t2 - t1, t3 - t2))
    return rows


async def episodes(be: DockerSandboxBackend, k: int, env: str, task_id: str) -> tuple[float, int, float]:
    hub = Hub()
    source = hub.create("environment", env, {"path": str(TASKS / env)}, where=env)
    await be.image_for(source.load_task(task_id).sandbox_spec(), be.run_id or "bench")  # build outside the timing
    agent = hub.create("agent", "oracle", {}, where="agent")
    t = time.perf_counter()
    results = await asyncio.gather(*(run_episode(source.load_task(task_id), agent, be) for _ in range(k)))
    wall = time.perf_counter() - t
    scores = [r.reward.reward for r in results]
    return wall, sum(s == 1.0 for s in scores), statistics.mean(s or 0.0 for s in scores)


def latency_row(name: str, rows: list[tuple[float, float, float]]) -> str:
    tot = [1e3 * sum(r) for r in rows]
    parts = [[1e3 * r[i] for r in rows] for i in range(3)]
    return (f"{name:<26} {pct(tot, 50):7.0f} {pct(tot, 95):7.0f} | {pct(parts[0], 50):10.0f} "
            f"{pct(parts[1], 50):9.0f} {pct(parts[1], 95):9.0f} {pct(parts[2], 50):11.0f}")


async def main(n: int, k: int, families: list[str] | None = None, cold: bool = True) -> None:
    be = DockerSandboxBackend(DockerSandboxOptions(run_id=f"bench-{os.getpid()}"))
    version = await be.ping()
    print(f"\ndocker backend: engine {version} via {be.cli.engine_name()} CLI {be.cli.executable()}; "
          f"host {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    try:
        if families is None:
            families = list(FAMILIES)
        if families:
            print(f"stand-in family images FROM {be.options.stand_in_base} (build network "
                  f"{be.options.build_network}; apt from the Debian mirror)")
            print(f"{'family':<16} {'cold build s':>12} {'cached ms':>10}")
            for family, cold_s, cached in await family_builds(be, families, cold):
                print(f"{family:<16} {cold_s:12.1f} {1e3 * cached:10.0f}")
        print(f"\ncreate + exec(true) + destroy, N={n} (ms)")
        print(f"{'image':<26} {'p50':>7} {'p95':>7} | {'create p50':>10} {'exec p50':>9} {'exec p95':>9} {'destroy p50':>11}")
        print(latency_row(be.options.default_image, await latency(be, n)))
        print(latency_row("python:3.12-slim", await latency(be, n, "python:3.12-slim")))
        if be.images_stood_in:
            print("stood in: " + ", ".join(f"{ref} -> {img}" for ref, img in be.images_stood_in.items()))
        print(f"\n{k} concurrent oracle episodes per task (image built from the task's Dockerfile before timing)")
        print(f"{'task':<32} {'wall s':>7} {'episodes/s':>11} {'reward 1.0':>11} {'mean':>6}")
        for env, task_id in EPISODE_TASKS:
            wall, solved, mean = await episodes(be, k, env, task_id)
            print(f"{env + '/' + task_id:<32} {wall:7.2f} {k / wall:11.2f} {solved:>11} {mean:6.2f}")
        stats = be.stats()
        print("backend metrics: " + ", ".join(f"{k.removeprefix('sandbox/')}={v:.3g}" for k, v in stats.items()))
    finally:
        await be.aclose()
        await be.sweep(be.run_id or "")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--families", default=",".join(FAMILIES), help="stand-in families to time ('' for none)")
    ap.add_argument("--no-cold", action="store_true", help="skip the --no-cache builds")
    a = ap.parse_args()
    asyncio.run(main(a.n, a.episodes, [f for f in a.families.split(",") if f], cold=not a.no_cold))

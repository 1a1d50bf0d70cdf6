"""Router load spread: N embedded-engine processes (supervised HTTP servers) behind the router,
S concurrent multi-turn sessions. Prints, per engine, sessions / requests / tokens / peak
in-flight tokens / prefix-cache hits, for the router (affinity + least-loaded) and, side by
side in the same run, a random-placement baseline on the same processes.

    .venv/bin/python bench/router_bench.py [--engines 4] [--sessions 64] [--turns 4] [--model tiny:qwen3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miles_engine.engines.launch import server_command
from miles_engine.engines.protocol import GenerateRequest, SamplingParams  # noqa: E402
from miles_engine.engines.router import EngineSlot, Router  # noqa: E402
from miles_engine.engines.supervisor import SupervisedEngine  # noqa: E402


class RandomRouter(Router):
    """Baseline: every request to a random engine (no affinity, no load awareness)."""

    rng = random.Random(0)

    def pick(self, session_id: str | None) -> EngineSlot:
        return self.rng.choice(self._admitted())


async def session(router: Router, sid: str, turns: int, rng: random.Random, vocab: int, log: list[Any]) -> None:
    row = [rng.randrange(1, vocab) for _ in range(rng.randint(16, 64))]
    for _ in range(turns):
        req = GenerateRequest(list(row), SamplingParams(max_new_tokens=rng.randint(8, 48), seed=rng.randrange(1 << 30)),
                              session_id=sid)
        res = await router.generate(req)
        log.append((sid, res.info["engine"], len(row), res.cached_tokens, len(res.output_ids)))
        row += res.output_ids + [rng.randrange(1, vocab) for _ in range(rng.randint(4, 16))]  # tool output
        await asyncio.sleep(rng.uniform(0.0, 0.05))  # the "environment" thinks
    router.end_session(sid)


async def run(router: Router, sessions: int, turns: int, tag: str, vocab: int) -> dict[str, Any]:
    log: list[Any] = []
    peak: dict[str, int] = {s.name: 0 for s in router.slots}
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            for s in router.slots:
                peak[s.name] = max(peak[s.name], s.inflight_tokens)
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    t0 = time.perf_counter()
    await asyncio.gather(*(session(router, f"{tag}{i}", turns, random.Random(i), vocab, log) for i in range(sessions)))
    wall = time.perf_counter() - t0
    done.set()
    await sampler
    return {"log": log, "peak": peak, "wall": wall}


def table(title: str, names: list[str], out: dict[str, Any]) -> list[float]:
    log = out["log"]
    homes: dict[str, set[str]] = {}
    for sid, eng, *_ in log:
        homes.setdefault(sid, set()).add(eng)
    print(f"\n{title}  (wall {out['wall']:.1f}s, {sum(r[4] for r in log) / out['wall']:.0f} tok/s)")
    print(f"{'engine':<10}{'sessions':>9}{'requests':>9}{'gen tok':>9}{'prompt tok':>11}"
          f"{'peak inflight':>14}{'cache hit':>10}")
    gen_per = []
    for name in names:
        rows = [r for r in log if r[1] == name]
        prompt, cached, gen = sum(r[2] for r in rows), sum(r[3] for r in rows), sum(r[4] for r in rows)
        n_sessions = sum(1 for s in homes.values() if name in s)
        gen_per.append(float(gen))
        print(f"{name:<10}{n_sessions:>9}{len(rows):>9}{gen:>9}{prompt:>11}{out['peak'][name]:>14}"
              f"{(cached / prompt if prompt else 0):>10.1%}")
    moved = sum(1 for s in homes.values() if len(s) > 1)
    cv = statistics.pstdev(gen_per) / statistics.mean(gen_per) if statistics.mean(gen_per) else 0.0
    total_hit = sum(r[3] for r in log) / max(sum(r[2] for r in log), 1)
    print(f"spread: max/min gen tokens {max(gen_per) / max(min(gen_per), 1):.2f}, CV {cv:.2f}; "
          f"sessions served by >1 engine: {moved}/{len(homes)}; prefix-cache hit {total_hit:.1%}")
    return [max(gen_per) / max(min(gen_per), 1), cv, total_hit]


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--model", default="tiny:qwen3")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    engines = [SupervisedEngine(server_command(a.model, threads=a.threads), name=f"proc{i}", env=env, cwd=ROOT,
                                start_timeout_s=300) for i in range(a.engines)]
    await asyncio.gather(*(e.start() for e in engines))
    print(f"{a.engines} engine processes ({a.model}, {a.threads} thread each) up in {time.perf_counter() - t0:.1f}s; "
          f"{a.sessions} concurrent sessions x {a.turns} turns on {os.cpu_count()} CPUs")
    names = [e.name for e in engines]
    vocab = 500
    try:
        routed = await run(Router(engines, health_interval_s=0), a.sessions, a.turns, "r", vocab)
        rand = await run(RandomRouter(engines, health_interval_s=0), a.sessions, a.turns, "x", vocab)
        r = table("router: affinity + least-loaded", names, routed)
        b = table("baseline: random placement", names, rand)
        print(f"\nside by side: max/min load {r[0]:.2f} vs {b[0]:.2f}; CV {r[1]:.2f} vs {b[1]:.2f}; "
              f"prefix-cache hit {r[2]:.1%} vs {b[2]:.1%}; wall {routed['wall']:.1f}s vs {rand['wall']:.1f}s")
    finally:
        await asyncio.gather(*(e.aclose() for e in engines))


if __name__ == "__main__":
    asyncio.run(main())

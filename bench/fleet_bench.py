"""Engine fleet figures (prints tables; not a test).

    .venv/bin/python bench/fleet_bench.py [--kills 3] [--engines 2] [--sessions 32] [--turns 4]

1. **Recovery after an engine SIGKILL**: a supervised engine server (``--model``, default a
   tiny Qwen3) with a ``restore`` callback holding "trainer" weights at version 7. Per kill: the
   process group is SIGKILLed and a one-token request is sent at once; it fails on the dead
   connection, waits out the restart and is re-sent. Columns: kill -> process ready (spawn,
   import, model load, ``/health``), -> restored (the trainer's tensors loaded, version 7),
   -> first token from the new process (the retried request's answer), and the version that
   token carries.
2. **Prefix reuse on multi-turn sessions**: ``--engines`` supervised servers, ``--sessions``
   concurrent sessions of ``--turns`` turns (tool output appended between turns), placed by the
   router (session affinity + least-loaded) vs at random on the same processes
   (:mod:`bench.router_bench`'s workload): share of prompt tokens served from the prefix cache
   (``cached_tokens``), sessions that moved between engines, wall time.
3. **Training throughput** (:mod:`bench.fleet_training`): samples/s of tiny-terminal with 1
   embedded engine vs 1 and 2 ``server`` engines (broadcast), resumed from one SFT warm start.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.router_bench import RandomRouter  # noqa: E402
from bench.router_bench import run as run_sessions  # noqa: E402
from miles_engine.engines.launch import server_command  # noqa: E402
from miles_engine.engines.protocol import GenerateRequest, SamplingParams  # noqa: E402
from miles_engine.engines.router import Router  # noqa: E402
from miles_engine.engines.supervisor import SupervisedEngine  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


class TimedSupervisedEngine(SupervisedEngine):
    """Records when each restarted process became ready and when its weights were restored."""

    marks: list[tuple[str, float]]

    async def _reapply(self, client: Any) -> int:
        self.marks.append(("ready", time.perf_counter()))
        version = await super()._reapply(client)
        self.marks.append(("restored", time.perf_counter()))
        return version


async def recovery(model: str, kills: int) -> list[dict[str, float]]:
    import torch

    trainer: dict[str, torch.Tensor] = {}

    async def restore() -> tuple[dict[str, torch.Tensor], int]:
        return trainer, 7

    sup = TimedSupervisedEngine(server_command(model, threads=1), name="bench", env=ENV, cwd=ROOT, restore=restore,
                                backoff_base_s=0.05, monitor_interval_s=0.05, start_timeout_s=120)
    sup.marks = []
    await sup.start()
    rows = []
    try:
        gen = torch.Generator().manual_seed(0)
        for m in sup.weight_metadata():
            trainer[m.name] = torch.randn(m.shape, generator=gen).to(getattr(torch, m.dtype)) * 0.02
        await sup.update_weights(trainer, version=7)
        probe = GenerateRequest([5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=1))
        await sup.generate(probe)  # warm
        for _ in range(kills):
            sup.marks.clear()
            t0 = time.perf_counter()
            os.killpg(sup.process.pid, signal.SIGKILL)
            res = await sup.generate(GenerateRequest([5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=1)))
            first = time.perf_counter()
            marks = dict(sup.marks)
            rows.append({"ready_s": marks["ready"] - t0, "restored_s": marks["restored"] - t0,
                         "first_token_s": first - t0, "version": float(res.weight_versions[0]),
                         "retries": float(res.info["retries"])})
            await asyncio.sleep(0.5)
    finally:
        await sup.aclose()
    return rows


async def prefix_reuse(model: str, engines: int, sessions: int, turns: int) -> dict[str, dict[str, Any]]:
    cmd = server_command(model, threads=1)
    sups = [SupervisedEngine(cmd, name=f"e{i}", env=ENV, cwd=ROOT, start_timeout_s=120) for i in range(engines)]
    await asyncio.gather(*(s.start() for s in sups))
    vocab = 256
    out = {}
    try:
        for tag, router in (("router", Router(sups, health_interval_s=0)),
                            ("random", RandomRouter(sups, health_interval_s=0))):
            t0 = time.perf_counter()
            result = await run_sessions(router, sessions, turns, tag, vocab)
            rows = result["log"]
            prompt, cached = sum(r[2] for r in rows), sum(r[3] for r in rows)
            homes: dict[str, set[str]] = {}
            for sid, engine, *_ in rows:
                homes.setdefault(sid, set()).add(engine)
            out[tag] = {"hit": cached / prompt if prompt else 0.0, "moved": sum(len(h) > 1 for h in homes.values()),
                        "sessions": len(homes), "wall": time.perf_counter() - t0, "requests": len(rows)}
    finally:
        await asyncio.gather(*(s.aclose() for s in sups))
    return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny:qwen3")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--skip", choices=["recovery", "prefix", "training"], action="append", default=[])
    p.add_argument("--steps", type=int, default=20, help="training part: RL steps per run")
    p.add_argument("--repeats", type=int, default=2, help="training part: interleaved rounds")
    p.add_argument("--sft-epochs", type=float, default=None,
                   help="training part: a shorter SFT warm start than the recipe's 5 epochs (a loaded box)")
    args = p.parse_args()
    if "recovery" not in args.skip:
        rows = await recovery(args.model, args.kills)
        print(f"\nRecovery after SIGKILL ({args.model}, restore callback, {args.kills} kills)")
        print(f"{'kill':>5}{'ready s':>10}{'restored s':>12}{'first token s':>15}{'version':>9}{'retries':>9}")
        for i, r in enumerate(rows):
            print(f"{i + 1:>5}{r['ready_s']:>10.2f}{r['restored_s']:>12.2f}{r['first_token_s']:>15.2f}"
                  f"{r['version']:>9.0f}{r['retries']:>9.0f}")
    if "prefix" not in args.skip:
        out = await prefix_reuse(args.model, args.engines, args.sessions, args.turns)
        print(f"\nPrefix reuse: {args.engines} engines, {args.sessions} sessions x {args.turns} turns")
        print(f"{'placement':>10}{'cache hit':>11}{'moved sessions':>16}{'wall s':>9}")
        for tag, r in out.items():
            print(f"{tag:>10}{r['hit']:>11.1%}{r['moved']:>10}/{r['sessions']:<5}{r['wall']:>9.1f}")
    if "training" not in args.skip:
        from bench.fleet_training import measure, report

        report(await asyncio.to_thread(measure, args.steps, args.repeats, None, args.sft_epochs), args.steps)


if __name__ == "__main__":
    asyncio.run(main())

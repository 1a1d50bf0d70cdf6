"""Our engine against a real vLLM, on SmolLM2-135M (the offline GGUF, float32), both as the run
launches them (``kind: server`` and ``kind: vllm``: separate processes on loopback, one replica each)
(prints tables; not a test).

    .venv/bin/python bench/engine_ab.py                 # 3 interleaved repeats
    .venv/bin/python bench/engine_ab.py --repeats 5 --compiled   # + vLLM without --enforce-eager

Per repeat, engines interleaved:
- GRPO wave: 8 prompts x 8 samples (256-token prompts), 48 new tokens each at T=1, all at once;
- multi-turn sessions: 8 sessions x 4 turns, each turn's prompt the previous prompt + its completion
  + 32 new tokens (prefix reuse: our prompt cache, vLLM's prefix caching);
- one weight push: the whole model, through the broadcast transport (gloo), timed to the engine
  reporting the new version.
Tokens/s is sampled tokens over the wall time of the batch. Medians and ranges over the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_engine.engines.fleet.config import EngineGroupConfig, ServerKindOptions  # noqa: E402
from miles_engine.engines.fleet.kinds import FleetContext  # noqa: E402
from miles_engine.engines.fleet.server import ServerKind  # noqa: E402
from miles_engine.engines.fleet.vllm_kind import VllmKind  # noqa: E402
from miles_engine.engines.protocol import GenerateRequest, SamplingParams  # noqa: E402
from miles_engine.engines.vllm.options import VllmKindOptions  # noqa: E402
from miles_engine.models.loading import load_model  # noqa: E402
from tests.smollm2 import smollm2_gguf_path  # noqa: E402


async def grpo_wave(engine, prompts: list[list[int]], group: int, new: int, seed: int) -> float:
    sp = [SamplingParams(temperature=1.0, max_new_tokens=new, seed=seed * 1000 + i) for i in range(group)]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(GenerateRequest(p, s)) for p in prompts for s in sp))
    return sum(len(r.output_ids) for r in results) / (time.perf_counter() - t0)


async def sessions(engine, prompts: list[list[int]], turns: int, new: int, gen: torch.Generator) -> float:
    async def one(prompt: list[int]) -> int:
        sampled = 0
        for _ in range(turns):
            r = await engine.generate(GenerateRequest(prompt, SamplingParams(temperature=1.0, max_new_tokens=new)))
            sampled += len(r.output_ids)
            prompt = prompt + r.output_ids + torch.randint(100, 40000, (32,), generator=gen).tolist()
        return sampled

    t0 = time.perf_counter()
    total = sum(await asyncio.gather(*(one(p) for p in prompts)))
    return total / (time.perf_counter() - t0)


async def push_seconds(engine, weights: dict[str, torch.Tensor], version: int) -> float:
    from miles_engine.weights.broadcast import BroadcastTransport

    transport = BroadcastTransport([engine], backend="gloo")
    try:
        t0 = time.perf_counter()
        await transport.push(list(weights.items()), version)
        return time.perf_counter() - t0
    finally:
        await transport.close()


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} [{min(values):.1f}-{max(values):.1f}]"


async def main(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model, _ = load_model(str(smollm2_gguf_path()), dtype="float32")
    weights = {n: t.detach().clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (256,), generator=gen).tolist() for _ in range(8)]
    with tempfile.TemporaryDirectory(prefix="engine-ab-") as tmp:
        hf = Path(tmp) / "smollm2"
        model.save_pretrained(str(hf), safe_serialization=True)
        kinds = {"miles server": ServerKind(ServerKindOptions(threads=2, max_batch_size=64)),
                 "vLLM (eager)": VllmKind(VllmKindOptions(max_model_len=2048, cpu_kv_cache_gib=4))}
        if args.compiled:
            kinds["vLLM (compiled)"] = VllmKind(VllmKindOptions(max_model_len=2048, cpu_kv_cache_gib=4, enforce_eager=False))
        results: dict[str, dict[str, list[float]]] = {k: {"wave": [], "sessions": [], "push": [], "start": []}
                                                      for k in kinds}
        async with AsyncExitStack() as stack:
            engines = {}
            for name, kind in kinds.items():
                t0 = time.perf_counter()
                ctx = FleetContext(model=str(hf), state_dir=Path(args.state_dir or tmp) / name.replace(" ", "_"), seed=0)
                [engines[name]] = await kind.start(EngineGroupConfig(kind="bench"), name, ctx, stack)
                results[name]["start"].append(time.perf_counter() - t0)
            for rep in range(args.repeats):
                for name, engine in engines.items():
                    results[name]["wave"].append(await grpo_wave(engine, prompts, 8, 48, rep))
                    results[name]["sessions"].append(await sessions(engine, prompts, 4, 24, gen))
                    results[name]["push"].append(await push_seconds(engine, weights, rep + 1))
                    print(f"repeat {rep + 1}: {name}: wave {results[name]['wave'][-1]:.1f} tok/s, sessions "
                          f"{results[name]['sessions'][-1]:.1f} tok/s, push {results[name]['push'][-1]:.2f} s",
                          flush=True)
    base = statistics.median(results["miles server"]["wave"])
    print("\n| engine | start, s | GRPO wave, tok/s | vs ours | sessions, tok/s | push, s |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['start'][0]:.0f} | {fmt(r['wave'])} | {statistics.median(r['wave']) / base:.2f}x | "
              f"{fmt(r['sessions'])} | {statistics.median(r['push']):.2f} [{min(r['push']):.2f}-{max(r['push']):.2f}] |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compiled", action="store_true", help="also vLLM without --enforce-eager")
    parser.add_argument("--state-dir", default=None, help="keep the engines' logs here (default: a temporary directory)")
    asyncio.run(main(parser.parse_args()))

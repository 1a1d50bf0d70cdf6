"""Embedded-engine benchmark (prints tables; not a test).

    .venv/bin/python bench/engine_bench.py [--reps 5] [--dtype float32] [--threads 1] [--quick]
    .venv/bin/python bench/engine_bench.py --true-on-policy [--reps 5] [--quick]   # section 5 only

1. Decode throughput (tokens/s) on the tiny Qwen3 config of the feasibility study (vocab 8192,
   hidden 256, 4 layers, 4 heads / 2 KV, head_dim 64) at batch 1, 8, 32: the engine (B
   concurrent requests) vs Hugging Face ``generate`` on the same model and batch; prompt 32,
   128 new tokens, greedy, eos disabled; runs interleaved, medians, ratio side by side.
2. Mixed lengths: 128 requests queued at once (an RL rollout wave), max_new_tokens drawn from
   16..256; the engine runs them with continuous batching (max batch 32), HF in static
   batches of 32 that run to the longest request of the batch. Useful tokens/s = requested
   tokens / wall time.
3. Prefix reuse: 4 concurrent 8-turn sessions (128 new prompt tokens + 32 generated per turn):
   time to first token and turn latency with the session prefix cache vs without (same
   requests, interleaved turn by turn, outputs checked identical), and the hit rates.
4. GRPO groups: waves of 8 groups x 8 attempts (one prompt per group, attempts arriving within
   a few ms, 64 new tokens sampled): engine busy time per sample and prefilled tokens with the
   shared-prompt cache vs without (interleaved waves, medians).

5. ``--true-on-policy`` (instead of 1-4): the cost of the batch-invariant mode. Two engines of
   the same weights, ``true_on_policy`` off and on (float32, prompt cache off), the same work
   alternated between them: greedy decode tokens/s at batch 1, 8, 32, and useful tokens/s of a
   mixed-length wave (continuous batching), per second of wall time and per CPU second of this
   process; median and range over the repetitions, on/off ratio.

Sections 1-3 run with the shared-prompt cache off (their repetitions reuse prompts, and HF
generate has no such cache).
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from miles_engine.engines.embedded.engine import EmbeddedEngine  # noqa: E402
from miles_engine.engines.protocol import GenerateRequest, SamplingParams  # noqa: E402

# the dense reference config of the CPU feasibility study (bench size)
CONFIG = dict(model_type="qwen3", vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, eos_token_id=None, bos_token_id=None,
              pad_token_id=0)
PROMPT = 32


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG["vocab_size"], (n, length), generator=g).tolist()


async def engine_run(eng: EmbeddedEngine, batch: list[list[int]], lengths: list[int]) -> float:
    t = time.perf_counter()
    await asyncio.gather(*(eng.generate(GenerateRequest(p, SamplingParams(temperature=0, max_new_tokens=n)))
                           for p, n in zip(batch, lengths)))
    return time.perf_counter() - t


def hf_run(model, batch: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(batch)
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


async def decode_throughput(eng: EmbeddedEngine, reps: int, batches: list[int], new: int) -> None:
    rows = []
    for b in batches:
        batch = prompts(b, PROMPT, b)
        await engine_run(eng, batch[:1], [4])  # warm-up
        hf_run(eng.model, batch[:1], 4)
        ours, theirs = [], []
        for _ in range(reps):  # interleaved
            ours.append(b * new / await engine_run(eng, batch, [new] * b))
            theirs.append(b * new / hf_run(eng.model, batch, new))
        o, h = statistics.median(ours), statistics.median(theirs)
        rows.append([str(b), f"{o:,.0f}", f"{h:,.0f}", f"{o / h:.2f}x", f"{1000 * b / o:.2f}"])
    table(f"1. decode throughput, prompt {PROMPT}, {new} new tokens, greedy (median of {reps})",
          ["batch", "engine tok/s", "HF generate tok/s", "ratio", "engine ms/step"], rows)


async def mixed_lengths(eng: EmbeddedEngine, reps: int, n: int, lo: int, hi: int, batch_size: int = 32) -> None:
    rng = random.Random(0)
    lengths = [rng.randint(lo, hi) for _ in range(n)]
    batch = prompts(n, PROMPT, 7)
    useful = sum(lengths)
    ours, theirs, steps, rows = [], [], 0, 0
    for _ in range(reps):
        before = eng.stats()
        ours.append(useful / await engine_run(eng, batch, lengths))
        after = eng.stats()
        steps, rows = after["steps"] - before["steps"], after["batch_rows"] - before["batch_rows"]
        t = 0.0
        for i in range(0, n, batch_size):
            t += hf_run(eng.model, batch[i : i + batch_size], max(lengths[i : i + batch_size]))
        theirs.append(useful / t)
    hf_steps = sum(max(lengths[i : i + batch_size]) for i in range(0, n, batch_size))
    o, h = statistics.median(ours), statistics.median(theirs)
    table(f"2. mixed lengths: {n} requests queued at once, max_new_tokens in {lo}..{hi} ({useful} tokens), "
          f"batch {batch_size} (median of {reps})",
          ["engine useful tok/s", "HF static-batch useful tok/s", "ratio", "engine steps (mean batch)",
           "HF steps (batch)"],
          [[f"{o:,.0f}", f"{h:,.0f}", f"{o / h:.2f}x", f"{steps} ({rows / max(steps, 1):.1f})",
            f"{hf_steps} ({batch_size})"]])


async def sessions(eng_reuse: EmbeddedEngine, eng_plain: EmbeddedEngine, n_sessions: int, turns: int,
                   user: int, new: int) -> None:
    """Turn by turn, the same requests go to the engine with the session cache and then to
    one without it (same weights; the rows follow the reuse engine's outputs)."""
    rows = [prompts(1, user, 1000 + s)[0] for s in range(n_sessions)]
    sp = SamplingParams(temperature=0, max_new_tokens=new)
    table_rows = []
    same = 0
    for turn in range(turns):
        measured = {}
        for name, eng in (("reuse", eng_reuse), ("plain", eng_plain)):
            t = time.perf_counter()
            res = await asyncio.gather(*(eng.generate(GenerateRequest(r, sp, session_id=f"s{s}"))
                                         for s, r in enumerate(rows)))
            measured[name] = (time.perf_counter() - t, res)
        (wall_a, res_a), (wall_b, res_b) = measured["reuse"], measured["plain"]
        same += sum(a.output_ids == b.output_ids for a, b in zip(res_a, res_b))
        ttft_a = statistics.median(r.info["ttft_s"] for r in res_a)
        ttft_b = statistics.median(r.info["ttft_s"] for r in res_b)
        cached = statistics.median(r.cached_tokens for r in res_a)
        table_rows.append([str(turn + 1), str(len(rows[0])), f"{cached:.0f}", f"{1000 * ttft_a:.0f}",
                           f"{1000 * ttft_b:.0f}", f"{1000 * wall_a:.0f}", f"{1000 * wall_b:.0f}",
                           f"{wall_b / wall_a:.2f}x"])
        rows = [r + out.output_ids + prompts(1, user, 2000 + 100 * s + turn)[0]
                for s, (r, out) in enumerate(zip(rows, res_a))]
    st = eng_reuse.stats()
    table(f"3. prefix reuse: {n_sessions} concurrent sessions x {turns} turns (+{user} prompt tokens, {new} new "
          f"per turn); hit rate {st['session_hit_rate']:.3f}, prompt-token hit rate "
          f"{st['session_token_hit_rate']:.3f}; identical outputs with and without reuse: "
          f"{same}/{turns * n_sessions} (fp32: all; bf16 may flip near-ties)",
          ["turn", "prompt", "cached", "TTFT ms reuse", "TTFT ms none", "turn ms reuse", "turn ms none", "speed-up"],
          table_rows)


async def grpo_groups(shared: EmbeddedEngine, plain: EmbeddedEngine, waves: int, prompt_len: int, new: int) -> None:
    async def wave(eng: EmbeddedEngine, w: int) -> tuple[float, int]:
        async def attempt(group: int, i: int):
            ids = prompts(1, prompt_len, seed=1000 * w + group)[0]
            await asyncio.sleep(0.001 * i)
            sp = SamplingParams(temperature=1.0, max_new_tokens=new, seed=64 * w + 8 * group + i)
            return await eng.generate(GenerateRequest(input_ids=ids, sampling=sp))

        before = eng.stats()
        await asyncio.gather(*[attempt(g, i) for g in range(8) for i in range(8)])
        after = eng.stats()
        return 1000 * (after["busy_s"] - before["busy_s"]) / 64, after["prefill_tokens"] - before["prefill_tokens"]

    got: dict[str, list[tuple[float, int]]] = {"shared": [], "none": []}
    for w in range(waves):
        got["shared"].append(await wave(shared, w))
        got["none"].append(await wave(plain, w))
    med = {k: (statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals)) for k, vals in got.items()}
    table(f"4. GRPO groups: {waves} waves of 8 groups x 8 attempts, prompt {prompt_len}, {new} new tokens, T=1 "
          f"(median per wave)", ["prompt cache", "engine busy ms/sample", "prefilled tokens/wave"],
          [[k, f"{ms:.3f}", str(tokens)] for k, (ms, tokens) in med.items()]
          + [["ratio none/shared", f"{med['none'][0] / med['shared'][0]:.2f}x", ""]])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} [{min(values):,.0f}-{max(values):,.0f}]"


async def true_on_policy_cost(reps: int, batches: list[int], new: int, n_mixed: int, hi: int, threads: int) -> None:
    engines = {mode: EmbeddedEngine.from_model(CONFIG, num_threads=threads, true_on_policy=mode == "on",
                                               max_batch_size=32, prompt_cache_tokens=0) for mode in ("off", "on")}
    rng = random.Random(0)
    mixed = (prompts(n_mixed, PROMPT, 7), [rng.randint(16, hi) for _ in range(n_mixed)])
    work = [(f"decode, batch {b}", prompts(b, PROMPT, b), [new] * b) for b in batches]
    work.append((f"mixed wave: {n_mixed} requests, 16..{hi} new", *mixed))
    rows = []
    try:
        for name, batch, lengths in work:
            for eng in engines.values():
                await engine_run(eng, batch[:1], [4])  # warm-up
            wall: dict[str, list[float]] = {"off": [], "on": []}
            cpu: dict[str, list[float]] = {"off": [], "on": []}
            for _ in range(reps):  # interleaved
                for mode, eng in engines.items():
                    c0 = time.process_time()
                    wall[mode].append(sum(lengths) / await engine_run(eng, batch, lengths))
                    cpu[mode].append(sum(lengths) / (time.process_time() - c0))
            ratio = statistics.median(cpu["on"]) / statistics.median(cpu["off"])
            rows.append([name, spread(wall["off"]), spread(wall["on"]), spread(cpu["off"]), spread(cpu["on"]),
                         f"{ratio:.2f}x"])
    finally:
        for eng in engines.values():
            await eng.aclose()
    table(f"5. true_on_policy cost: engine tokens per second of wall time and per CPU second (this process's CPU "
          f"time: the cost on a shared box), mode off vs on (float32, greedy, prompt {PROMPT}; median [range] of "
          f"{reps}, interleaved)", ["work", "off tok/s", "on tok/s", "off tok/CPU-s", "on tok/CPU-s", "on/off (CPU)"],
          rows)


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, dtype {args.dtype}, "
          f"cpu count {os.cpu_count()}")
    if args.true_on_policy:
        await true_on_policy_cost(args.reps, [1, 8] if args.quick else [1, 8, 32], 32 if args.quick else 128,
                                  32 if args.quick else args.mixed_requests, 64 if args.quick else 256, args.threads)
        return
    eng = EmbeddedEngine.from_model(CONFIG, dtype=args.dtype, num_threads=args.threads, max_batch_size=32,
                                    prompt_cache_tokens=0)
    batches = [1, 8] if args.quick else [1, 8, 32]
    await decode_throughput(eng, args.reps, batches, 32 if args.quick else 128)
    await mixed_lengths(eng, max(1, args.reps // 2), 32 if args.quick else args.mixed_requests, 16,
                        64 if args.quick else 256)
    plain = EmbeddedEngine.from_model(CONFIG, dtype=args.dtype, num_threads=args.threads, session_cache_tokens=0,
                                      prompt_cache_tokens=0)
    await sessions(eng, plain, 4, 4 if args.quick else 8, 128, 32)
    await eng.aclose()
    shared = EmbeddedEngine.from_model(CONFIG, dtype=args.dtype, num_threads=args.threads, max_batch_size=64)
    plain64 = EmbeddedEngine.from_model(CONFIG, dtype=args.dtype, num_threads=args.threads, max_batch_size=64,
                                        prompt_cache_tokens=0)
    await grpo_groups(shared, plain64, 2 if args.quick else 6, 256, 16 if args.quick else 64)
    for e in (plain, shared, plain64):
        await e.aclose()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--mixed-requests", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--true-on-policy", action="store_true",
                   help="only section 5: engine tokens/s with true_on_policy off vs on")
    asyncio.run(main(p.parse_args()))

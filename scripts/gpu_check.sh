#!/usr/bin/env bash
# Checks that need a GPU, one delimited section per check (add yours as a new section).
# Usage: scripts/gpu_check.sh [section ...]   (no argument: every section). Nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
want() { [ $# -eq 0 ] || [[ " ${SECTIONS} " == *" $1 "* ]]; }
SECTIONS="${*:-}"
failed=0

# ---------------------------------------------------------------- section: true-on-policy
# Issue 21: trainer log-probs == engine log-probs on CUDA (batch-invariant mode), dense tiny and tiny
# MoE, 64 rows of mixed lengths. cuBLAS is deterministic per shape only with a fixed workspace.
if [ -z "${SECTIONS}" ] || want true-on-policy; then
  echo "== true-on-policy"
  CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m pytest tests/batch_invariant/test_true_on_policy.py -m gpu -q \
    -p no:cacheprovider -rs || failed=1
fi
# ---------------------------------------------------------------- end section: true-on-policy

# ---------------------------------------------------------------- section: topology
# Issue 13: tiny-terminal with the engines and the trainer on CUDA, a few RL steps, every tensor
# compared after every push (weights.check_update_equal): an embedded engine over colocated, then
# two `server` engine processes (bf16) over broadcast (NCCL). Prints step time, push time, tokens/s.
# GPU_CHECK_DEVICE=cpu runs the same section on CPU (gloo): a dry run of the script's own logic.
if [ -z "${SECTIONS}" ] || want topology; then
  out=$(mktemp -d)
  dev=${GPU_CHECK_DEVICE:-cuda}
  quick=(run.steps=4 run.max_minutes=null metrics.progress=false sft.demos=320 sft.epochs=1
         trainer.sft.lr_schedule.total_steps=10 trainer.sft.lr_schedule.warmup_steps=2
         "trainer.parallel.device=${dev}" weights.check_update_equal=true "run.out_dir=${out}")
  for variant in embedded server; do
    echo "== topology: ${variant} (${dev})"
    if [ "${variant}" = embedded ]; then
      fleet=("engines=[{kind: embedded, device: ${dev}}]" weights.transport=colocated placement.trainer=in_process
             rollout.mode=sync)
    else
      fleet=("engines=[{kind: server, replicas: 2, device: ${dev}, dtype: bfloat16}]" weights.transport=broadcast)
    fi
    timeout "${GPU_CHECK_RUN_TIMEOUT_S:-300}" python -m miles_engine.cli.main train tiny-terminal "${quick[@]}" \
      "${fleet[@]}" "run.name=${variant}" || { failed=1; continue; }
    python - "${out}/${variant}/metrics.jsonl" <<'PY' || failed=1
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if r.get("kind") == "train"]  # compact JSON lines
med = lambda k: statistics.median(r.get(k, float("nan")) for r in rows)
print(f"steps {len(rows)}  s/step {med('time/train') + med('time/wait'):.3f}  push_s {med('weights/push_s'):.3f}  "
      f"tensors checked/push {med('weights/tensors_checked'):.0f}  engines tokens/s "
      f"{med('engines/tokens_per_s') if 'engines/tokens_per_s' in rows[-1] else med('engine/output_tokens_per_s'):.0f}")
assert len(rows) == 4 and all(r["weights/tensors_checked"] > 0 for r in rows), "a push was not checked"
PY
  done
fi
# ---------------------------------------------------------------- end section: topology

# ---------------------------------------------------------------- section: megatron
# Issue 17: trainer.backend=megatron, TP=1, bf16 autocast (fp32 master weights): one GRPO step of a
# ~0.5B Qwen3 (Qwen3-0.6B shape, random weights) on 64 rows; prints step time and peak GPU memory.
# megatron-core 0.16.1 must be importable (pip install --no-deps megatron-core==0.16.1, or its wheel).
if [ -z "${SECTIONS}" ] || want megatron; then
  echo "== megatron: TP=1 bf16 GRPO step, ~0.5B Qwen3"
python - <<'PYEOF' || failed=1
import importlib.util, sys, time
if importlib.util.find_spec("megatron") is None:
    print("SKIP: megatron-core is not installed"); sys.exit(0)
import torch
if not torch.cuda.is_available():
    print("SKIP: no CUDA device"); sys.exit(0)
from miles_engine.rollout.types import Group, Trajectory
from miles_engine.trainer.factory import create_trainer

MODEL = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
             tie_word_embeddings=True, pad_token_id=0)
cfg = {"backend": "megatron", "megatron": {"tensor_parallel": 1}, "parallel": {"device": "cuda"},
       "dtype": "bfloat16", "optimizer": {"lr": 1e-6}, "num_threads": 4, "max_tokens_per_micro_batch": 8192}
gen = torch.Generator().manual_seed(0)
groups = []
for g in range(8):
    prompt = torch.randint(3, 151000, (256,), generator=gen).tolist()
    trajs = []
    for j in range(8):
        n = 128 + 16 * j
        ids = prompt + torch.randint(3, 151000, (n,), generator=gen).tolist()
        mask = [0] * len(prompt) + [1] * n
        trajs.append(Trajectory(ids, mask, [-2.0 if m else 0.0 for m in mask], [0 if m else None for m in mask],
                                reward=float((g + j) % 2), index=j))
    groups.append(Group(f"g{g}", f"t{g}", trajs, 0))
t0 = time.perf_counter()
tr = create_trainer(MODEL, cfg, world_size=1)
print(f"ranks started in {time.perf_counter() - t0:.1f} s")
try:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        m = tr.train_step(groups)
        times.append(time.perf_counter() - t0)
    from miles_engine.trainer.megatron.checks import step_shapes
    info = tr.call(step_shapes)
    print(f"params per rank: {info['params'] / 1e6:.0f} M; loss {m['loss']:.4f}; grad_norm {m['grad_norm']:.3f}")
    print(f"step time (s): first {times[0]:.2f}, then {', '.join(f'{t:.2f}' for t in times[1:])}")
    print(f"peak GPU memory (GiB, rank 0): {info['max_memory_gib']:.2f}")
finally:
    tr.close()
PYEOF
fi
# ---------------------------------------------------------------- end section: megatron

# ---------------------------------------------------------------- section: qwen3-terminal
# Issue 14: a few RL steps of the packaged GPU recipe with a ~0.5B random-initialised Qwen3
# (config-only directory; tokenizer builtin:qwen3); prints rollout tokens/s and step time per step.
if [ -z "${SECTIONS}" ] || want qwen3-terminal; then
  WORK=$(mktemp -d)
  echo "=== qwen3-terminal ==="
  MODEL="$WORK/qwen3-0.5b"
  mkdir -p "$MODEL"
  cat > "$MODEL/config.json" <<'JSON'
{"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
 "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64,
 "max_position_embeddings": 8192, "tie_word_embeddings": true, "rms_norm_eps": 1e-6,
 "eos_token_id": 151645, "pad_token_id": 151643}
JSON
  python -m miles_engine.cli.main recipes validate qwen3-terminal model.path="$MODEL" || failed=1
  timeout 420 python -m miles_engine.cli.main train qwen3-terminal model.path="$MODEL" run.steps=3 run.checkpoint_every=0 \
    rollout.group_size=4 rollout.groups_per_step=2 rollout.max_inflight=8 agent.options.max_tokens=256 \
    agent.options.max_turns=4 weights.check_update_equal=true metrics.progress=false \
    run.out_dir="$WORK/runs" run.name=qwen3-terminal || failed=1
  python - "$WORK/runs/qwen3-terminal/metrics.jsonl" <<'PY' || failed=1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().endswith("}")]
rows = [r for r in rows if r.get("kind") == "train"]
print(f"{'step':>4} {'step_s':>8} {'train_s':>8} {'engine tok/s':>12} {'reward':>7} {'|lp gap|':>9}")
for r in rows:
    print(f"{r['step']:>4} {r.get('time/step', float('nan')):>8.2f} {r.get('time/train', float('nan')):>8.2f} "
          f"{r.get('engine/output_tokens_per_s', float('nan')):>12.1f} {r.get('reward/mean', float('nan')):>7.3f} "
          f"{r.get('tis/logprob_abs_diff', float('nan')):>9.2e}")
assert len(rows) == 3, f"expected 3 RL steps, got {len(rows)}"
PY
  echo "=== qwen3-terminal: ok ==="
fi
# ---------------------------------------------------------------- end section: qwen3-terminal

# ---------------------------------------------------------------- section: precision
# Issue 30: the quantizer gives the same bytes on CUDA as on CPU (every format, random tensors of many
# scales and the special blocks), then tiny-terminal served in FP8 on CUDA with every push checked: the
# engine quantises on the GPU, the check on the CPU, so a single differing byte stops the run.
if [ -z "${SECTIONS}" ] || want precision; then
  echo "== precision: quantizer bytes CUDA == CPU"
  python - <<'PY' || failed=1
import math, torch
from miles_engine.precision.quantizer import quantize
g = torch.Generator().manual_seed(0)
cases = [torch.randn(256, 512, generator=g) * s for s in (1e-6, 1e-2, 1.0, 1e4)]
cases.append(torch.randn(256, 512, generator=g) * torch.exp(torch.randn(256, 512, generator=g) * 4))
special = torch.randn(6, 512, generator=g)
special[0] = 0; special[1, 5] = math.nan; special[2, 7] = -math.inf; special[3] = 1e-40; special[4] = 3e38
cases.append(special)
bad = 0
for fmt in ("fp8", "mxfp8", "nvfp4", "int4"):
    for x in cases:
        a, b = quantize(x, fmt).parts(), quantize(x.cuda(), fmt).parts()
        same = all(torch.equal(a[k].contiguous().view(torch.uint8), b[k].cpu().contiguous().view(torch.uint8)) for k in a)
        bad += not same
        print(f"{fmt:6} {tuple(x.shape)} {'same bytes' if same else 'DIFFER'}")
assert bad == 0, f"{bad} cases differ between CUDA and CPU"
PY
  out=$(mktemp -d)
  echo "== precision: tiny-terminal, FP8 serve on CUDA, every push checked"
  timeout "${GPU_CHECK_RUN_TIMEOUT_S:-300}" python -m miles_engine.cli.main train tiny-terminal run.steps=3 \
    run.max_minutes=null metrics.progress=false sft.enabled=false precision.rollout=fp8 weights.check_update_equal=true \
    "engines=[{kind: embedded, device: cuda}]" trainer.parallel.device=cuda placement.trainer=in_process \
    rollout.mode=sync "run.out_dir=${out}" run.name=fp8 || failed=1
fi
# ---------------------------------------------------------------- end section: precision

# ---------------------------------------------------------------- section: fp8-serving
# Issue 30: "full-precision train + FP8 serve" on CUDA servers: tiny-terminal, 3 RL steps from scratch,
# the run writing the FP8 checkpoint, every push (codes as float8 + weight_scale_inv over NCCL) read
# back equal, the train-rollout log-prob gap bounded. vLLM needs a CUDA vLLM environment at
# MILES_VLLM_PYTHON (the bridge travels with the repository); SGLang needs `import sglang` here. A
# server that is not installed is reported and skipped, not failed: these are the paths no CPU
# box can run (SGLang on CPU is refused: gloo cannot carry float8).
if [ -z "${SECTIONS}" ] || want fp8-serving; then
  fp8=(run.steps=3 run.max_minutes=null metrics.progress=false sft.enabled=false precision.rollout=fp8
       "precision.exceptions=['*.self_attn.[qkv]_proj.weight']" precision.max_logprob_gap=0.5
       weights.transport=broadcast weights.check_update_equal=true rollout.mode=sync trainer.parallel.device=cuda)
  fp8_serve() {  # name, engines list
    echo "== fp8-serving: $1 (CUDA)"
    local out; out=$(mktemp -d)
    timeout "${GPU_CHECK_RUN_TIMEOUT_S:-600}" python -m miles_engine.cli.main train tiny-terminal "${fp8[@]}" \
      "engines=$2" "run.out_dir=${out}" "run.name=$1-fp8" || failed=1
  }
  if [ -n "${MILES_VLLM_PYTHON:-}" ] && "${MILES_VLLM_PYTHON}" -c "import vllm, torch; assert torch.cuda.is_available()"; then
    fp8_serve vllm "[{kind: vllm, device: cuda, dtype: bfloat16}]"
  else
    echo "== fp8-serving: vllm skipped (no CUDA vLLM at MILES_VLLM_PYTHON)"
  fi
  if python -c "import sglang" 2>/dev/null; then
    fp8_serve sglang "[{kind: sglang, device: cuda, dtype: bfloat16}]"
  else
    echo "== fp8-serving: sglang skipped (not installed)"
  fi
fi
# ---------------------------------------------------------------- end section: fp8-serving

exit "${failed}"

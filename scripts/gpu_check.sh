#!/usr/bin/env bash
# GPU checks, one clearly delimited section per check. Run from the repo root on a CUDA machine:
#     scripts/gpu_check.sh            # every section
#     scripts/gpu_check.sh megatron   # one section
# Each section prints its figures, or SKIP with the reason.
set -u
PY=${PYTHON:-python}
want() { [ $# -eq 0 ] || [ "$1" = "$2" ]; }
section=${1:-}

# ============================================================================ megatron
# trainer.backend=megatron, TP=1, bf16 autocast (fp32 master weights): one GRPO step of a ~0.5B
# Qwen3 (Qwen3-0.6B shape, random weights) on 64 rows; prints step time and peak GPU memory.
# megatron-core 0.16.1 must be importable (pip install --no-deps megatron-core==0.16.1, or its wheel).
if want "$section" megatron; then
echo "=== megatron: TP=1 bf16 GRPO step, ~0.5B Qwen3 ==="
$PY - <<'PYEOF'
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

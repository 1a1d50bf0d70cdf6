#!/usr/bin/env bash
# GPU checks, one clearly delimited section per check. Run on a machine with a CUDA GPU:
#   bash scripts/gpu_check.sh            # every section
#   bash scripts/gpu_check.sh qwen3-terminal
# Nothing is downloaded: models are random-initialised from configs written here.
set -euo pipefail
cd "$(dirname "$0")/.."
ONLY="${1:-all}"
WORK="${GPU_CHECK_DIR:-$(mktemp -d /tmp/miles-gpu-check.XXXXXX)}"
echo "gpu_check: work dir $WORK"

# ======================================================================================
# section: qwen3-terminal  (issue 14) - a few RL steps of the packaged GPU recipe with a
# ~0.5B random-initialised Qwen3 (config-only directory; tokenizer builtin:qwen3); prints
# rollout tokens/s and step time per step.
# ======================================================================================
if [[ "$ONLY" == all || "$ONLY" == qwen3-terminal ]]; then
  echo "=== qwen3-terminal ==="
  MODEL="$WORK/qwen3-0.5b"
  mkdir -p "$MODEL"
  cat > "$MODEL/config.json" <<'JSON'
{"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
 "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64,
 "max_position_embeddings": 8192, "tie_word_embeddings": true, "rms_norm_eps": 1e-6,
 "eos_token_id": 151645, "pad_token_id": 151643}
JSON
  miles recipes validate qwen3-terminal model.path="$MODEL"
  timeout 1200 miles train qwen3-terminal model.path="$MODEL" run.steps=3 run.checkpoint_every=0 \
    rollout.group_size=4 rollout.groups_per_step=2 rollout.max_inflight=8 agent.options.max_tokens=256 \
    agent.options.max_turns=4 weights.check_update_equal=true metrics.progress=false \
    run.out_dir="$WORK/runs" run.name=qwen3-terminal
  python - "$WORK/runs/qwen3-terminal/metrics.jsonl" <<'PY'
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
# ====================================================================================== end

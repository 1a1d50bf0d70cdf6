#!/usr/bin/env bash
# Checks that need a GPU, one delimited section per check (add yours as a new section).
# Usage: scripts/gpu_check.sh [section ...]   (no argument: every section). Nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
want() { [ $# -eq 0 ] || [[ " ${SECTIONS} " == *" $1 "* ]]; }
SECTIONS="${*:-}"
failed=0

# ---------------------------------------------------------------- section: true-on-policy
# Issue 21: trainer log-probs == engine log-probs on CUDA (batch-invariant mode).
if [ -z "${SECTIONS}" ] || want true-on-policy; then
  echo "== true-on-policy"
  python -m pytest tests/batch_invariant/test_true_on_policy.py -m gpu -q -p no:cacheprovider || failed=1
fi
# ---------------------------------------------------------------- end section: true-on-policy

# ---------------------------------------------------------------- section: topology
# Issue 13: tiny-terminal with the engines and the trainer on CUDA, a few RL steps, every tensor
# compared after every push (weights.check_update_equal): an embedded engine over colocated, then
# two `server` engine processes (bf16) over broadcast (NCCL). Prints step time, push time, tokens/s.
if [ -z "${SECTIONS}" ] || want topology; then
  out=$(mktemp -d)
  quick=(run.steps=4 run.max_minutes=null metrics.progress=false sft.demos=320 sft.epochs=1
         trainer.sft.lr_schedule.total_steps=10 trainer.sft.lr_schedule.warmup_steps=2
         trainer.parallel.device=cuda weights.check_update_equal=true "run.out_dir=${out}")
  for variant in embedded server; do
    echo "== topology: ${variant}"
    if [ "${variant}" = embedded ]; then
      fleet=("engines=[{kind: embedded, device: cuda}]" weights.transport=colocated placement.trainer=in_process
             rollout.mode=sync)
    else
      fleet=("engines=[{kind: server, replicas: 2, device: cuda, dtype: bfloat16}]" weights.transport=broadcast)
    fi
    timeout 300 python -m miles_engine.cli.main train tiny-terminal "${quick[@]}" "${fleet[@]}" "run.name=${variant}" \
      || { failed=1; continue; }
    python - "${out}/${variant}/metrics.jsonl" <<'PY' || failed=1
import json, statistics, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if '"kind": "train"' in x]
med = lambda k: statistics.median(r.get(k, float("nan")) for r in rows)
print(f"steps {len(rows)}  s/step {med('time/train') + med('time/wait'):.3f}  push_s {med('weights/push_s'):.3f}  "
      f"tensors checked/push {med('weights/tensors_checked'):.0f}  engines tokens/s "
      f"{med('engines/tokens_per_s') if 'engines/tokens_per_s' in rows[-1] else med('engine/output_tokens_per_s'):.0f}")
assert len(rows) == 4 and all(r["weights/tensors_checked"] > 0 for r in rows), "a push was not checked"
PY
  done
fi
# ---------------------------------------------------------------- end section: topology

exit "${failed}"

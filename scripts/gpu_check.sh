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

exit "${failed}"

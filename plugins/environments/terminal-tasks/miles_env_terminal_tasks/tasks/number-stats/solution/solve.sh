#!/bin/bash
set -euo pipefail
cd /app
python3 - <<'PY'
from decimal import Decimal, ROUND_HALF_UP
vals = sorted(Decimal(l.strip()) for l in open("/app/measurements.txt") if l.strip() and not l.strip().startswith("#"))
q = lambda x: x.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
n = len(vals)
med = vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2
open("/app/stats.txt", "w").write(f"count={n}\nmin={q(vals[0])}\nmax={q(vals[-1])}\nmean={q(sum(vals) / n)}\nmedian={q(med)}\n")
PY

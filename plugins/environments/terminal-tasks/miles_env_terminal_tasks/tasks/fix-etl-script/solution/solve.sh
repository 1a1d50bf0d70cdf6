#!/bin/bash
set -euo pipefail
cd /app
python3 - <<'PY'
p = "/app/etl/summarize.py"
s = open(p).read()
s = s.replace('    for line in lines:\n        order = json.loads(line)\n',
              '    for line in lines:\n        if not line.strip():\n            continue\n        order = json.loads(line)\n')
s = s.replace('== "canceled"', '== "cancelled"')
s = s.replace('"total": 0}', '"total": 0.0}')
s = s.replace('int(float(order["amount"]))', 'float(order["amount"])')
s = s.replace('    return out\n',
              '    return {k: {"orders": v["orders"], "total": round(v["total"], 2)} for k, v in sorted(out.items())}\n')
open(p, "w").write(s)
PY
python3 /app/etl/summarize.py /app/etl/orders.jsonl /app/etl/summary.json

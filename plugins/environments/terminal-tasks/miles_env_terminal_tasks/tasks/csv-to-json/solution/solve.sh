#!/bin/bash
set -euo pipefail
cd /app
python3 - <<'PY'
import csv, json
with open("/app/people.csv", newline="", encoding="utf-8") as f:
    rows = [dict(r, age=int(r["age"])) for r in csv.DictReader(f)]
with open("/app/people.json", "w", encoding="utf-8") as f:
    json.dump(rows, f, indent=2, ensure_ascii=False)
PY

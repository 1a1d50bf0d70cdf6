#!/bin/bash
set -euo pipefail
cd /app
python3 - <<'PY'
import csv
from decimal import Decimal
tot = {}
with open("/app/sales.csv", newline="") as f:
    for row in csv.DictReader(f):
        tot[row["region"]] = tot.get(row["region"], Decimal(0)) + int(row["units"]) * Decimal(row["unit_price"])
with open("/app/revenue.csv", "w") as out:
    out.write("region,revenue\n")
    for r in sorted(tot):
        out.write(f"{r},{tot[r]:.2f}\n")
PY

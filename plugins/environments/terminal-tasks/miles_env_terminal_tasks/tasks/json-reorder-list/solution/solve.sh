#!/bin/bash
set -euo pipefail
cd /app
python3 - <<'PY'
import json
inv = json.load(open("/app/inventory.json"))
d = inv["default_reorder_level"]
names = sorted(i["name"] for i in inv["items"] if i["qty"] < i.get("reorder_level", d))
open("/app/reorder.txt", "w").write("".join(n + "\n" for n in names))
PY

#!/bin/bash
set -euo pipefail
cd /app
python3 - <<'PY'
p = "/app/stats/mathutils.py"
s = open(p).read()
s = s.replace("    n = len(values)\n    return values[n // 2]\n",
              "    s = sorted(values)\n    n = len(s)\n    if n % 2:\n        return s[n // 2]\n"
              "    return (s[n // 2 - 1] + s[n // 2]) / 2\n")
open(p, "w").write(s)
PY
cd /app/stats && python3 -m unittest -q

#!/bin/bash
set -euo pipefail
cd /app
cd /app/downloads
python3 - <<'PY'
import hashlib, os
bad = []
for line in open("SHA256SUMS"):
    digest, name = line.rstrip("\n").split("  ", 1)
    if not os.path.isfile(name) or hashlib.sha256(open(name, "rb").read()).hexdigest() != digest:
        bad.append(name)
open("/app/bad_files.txt", "w").write("".join(n + "\n" for n in sorted(bad)))
PY

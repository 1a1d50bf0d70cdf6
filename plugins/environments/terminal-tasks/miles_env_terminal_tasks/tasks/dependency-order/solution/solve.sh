#!/bin/bash
set -euo pipefail
cd /app
python3 - <<'PY'
import heapq
deps = {}
for line in open("/app/packages.txt"):
    line = line.strip()
    if not line or line.startswith("#"):
        continue
    name, _, rest = line.partition(":")
    deps[name.strip()] = rest.split()
indeg = {k: len(v) for k, v in deps.items()}
users = {k: [] for k in deps}
for k, v in deps.items():
    for d in v:
        users[d].append(k)
heap = [k for k, n in indeg.items() if n == 0]
heapq.heapify(heap)
order = []
while heap:
    k = heapq.heappop(heap)
    order.append(k)
    for u in users[k]:
        indeg[u] -= 1
        if indeg[u] == 0:
            heapq.heappush(heap, u)
open("/app/install_order.txt", "w").write("".join(k + "\n" for k in order))
PY

#!/bin/bash
set -euo pipefail
cd /app
python3 - <<'PY'
import json, re
from collections import Counter
pat = re.compile(r'^(\S+) \S+ \S+ \[[^\]]+\] "(\S+) (\S+) [^"]*" (\d{3}) (\S+)')
rows = [pat.match(l).groups() for l in open("/app/access.log") if l.strip()]
paths = Counter(p.split("?")[0] for _, _, p, _, _ in rows)
rep = {
    "total_requests": len(rows),
    "status_counts": dict(Counter(s for *_, s, _ in rows)),
    "top_path": paths.most_common(1)[0][0],
    "bytes_2xx": sum(int(b) for *_, s, b in rows if s.startswith("2") and b != "-"),
    "unique_ips": len({r[0] for r in rows}),
}
json.dump(rep, open("/app/report.json", "w"), indent=2)
PY

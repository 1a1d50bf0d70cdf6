#!/bin/bash
set -euo pipefail
cd /app
python3 - <<'PY'
import configparser, json, re
def coerce(v):
    if re.fullmatch(r"-?\d+", v):
        return int(v)
    if v.lower() in ("true", "yes"):
        return True
    if v.lower() in ("false", "no"):
        return False
    return v
cp = configparser.ConfigParser()
cp.read("/app/settings.ini")
json.dump({s: {k: coerce(v) for k, v in cp[s].items()} for s in cp.sections()}, open("/app/settings.json", "w"), indent=2)
PY

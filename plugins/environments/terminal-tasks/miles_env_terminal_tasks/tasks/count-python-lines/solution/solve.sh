#!/bin/bash
set -euo pipefail
cd /app
find /app/src -type f -name '*.py' -print0 | xargs -0 cat | wc -l > /app/py_lines.txt

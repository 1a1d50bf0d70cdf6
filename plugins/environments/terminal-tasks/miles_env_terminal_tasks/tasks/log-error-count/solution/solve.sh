#!/bin/bash
set -euo pipefail
cd /app
grep -c '^[^ ]* [^ ]* \[ERROR\]' /app/app.log > /app/error_count.txt || true

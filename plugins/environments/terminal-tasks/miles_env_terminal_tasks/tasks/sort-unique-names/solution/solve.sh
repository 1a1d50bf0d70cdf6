#!/bin/bash
set -euo pipefail
cd /app
LC_ALL=C sort -u /app/names.txt > /app/unique.txt
wc -l < /app/unique.txt > /app/count.txt

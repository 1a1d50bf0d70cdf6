#!/bin/bash
set -euo pipefail
cd /app
find /app/data -type f -size +2048c | LC_ALL=C sort > /app/large_files.txt

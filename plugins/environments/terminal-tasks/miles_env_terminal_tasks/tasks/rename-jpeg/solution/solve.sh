#!/bin/bash
set -euo pipefail
cd /app
find /app/photos -type f \( -name '*.jpeg' -o -name '*.JPEG' \) -print0 |
  while IFS= read -r -d '' f; do mv "$f" "${f%.*}.jpg"; done

#!/bin/bash
set -euo pipefail
cd /app
mkdir -p /app/bin
for f in /app/scripts/*.sh; do
  chmod +x "$f"
  ln -sfn "$f" "/app/bin/$(basename "$f" .sh)"
done

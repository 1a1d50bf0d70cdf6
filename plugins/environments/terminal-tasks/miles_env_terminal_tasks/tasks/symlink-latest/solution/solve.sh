#!/bin/bash
set -euo pipefail
cd /app
latest=$(ls /app/releases | sort -V | tail -n 1)
ln -sfn "/app/releases/$latest" /app/current

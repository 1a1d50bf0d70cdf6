#!/bin/bash
set -euo pipefail
cd /app
find /app/workspace -type f -name '*.tmp' -delete

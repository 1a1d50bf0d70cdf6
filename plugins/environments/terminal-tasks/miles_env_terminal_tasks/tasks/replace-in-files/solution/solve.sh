#!/bin/bash
set -euo pipefail
cd /app
find /app/etc -type f -name '*.conf' -exec sed -i 's/acme-old\.example\.com/acme.example.com/g' {} +

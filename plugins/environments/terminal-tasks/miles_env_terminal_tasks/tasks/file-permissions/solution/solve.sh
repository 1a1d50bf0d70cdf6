#!/bin/bash
set -euo pipefail
cd /app
chmod 700 /app/secrets
chmod 600 /app/secrets/api.key
chmod 755 /app/bin/deploy.sh /app/bin/status.sh
chmod 644 /app/public/index.html
chmod 640 /app/data/report.csv

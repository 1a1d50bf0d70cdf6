#!/bin/bash
set -euo pipefail
cd /app
sed -i 's/\r$//' /app/tools/greet.sh
chmod +x /app/tools/greet.sh

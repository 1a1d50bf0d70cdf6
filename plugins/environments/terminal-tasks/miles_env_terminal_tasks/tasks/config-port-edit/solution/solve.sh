#!/bin/bash
set -euo pipefail
cd /app
sed -i -e 's/^port = .*/port = 9090/' -e 's/^debug = .*/debug = false/' /app/server.conf

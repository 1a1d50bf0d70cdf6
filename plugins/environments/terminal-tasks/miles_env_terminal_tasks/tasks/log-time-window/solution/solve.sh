#!/bin/bash
set -euo pipefail
cd /app
awk 'substr($0, 1, 19) >= "2024-03-10T14:30:00" && substr($0, 1, 19) <= "2024-03-10T15:15:00"' /app/events.log > /app/window.log

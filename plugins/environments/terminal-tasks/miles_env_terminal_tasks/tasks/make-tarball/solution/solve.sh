#!/bin/bash
set -euo pipefail
cd /app
tar -czf /app/site-backup.tar.gz -C /app site

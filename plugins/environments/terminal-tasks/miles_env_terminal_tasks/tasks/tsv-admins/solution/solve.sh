#!/bin/bash
set -euo pipefail
cd /app
awk -F'\t' 'NR > 1 && $4 == "admin" {print $2}' /app/users.tsv > /app/admins.txt

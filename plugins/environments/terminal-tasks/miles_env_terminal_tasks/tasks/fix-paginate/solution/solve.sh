#!/bin/bash
set -euo pipefail
cd /app
sed -i 's/range(0, len(items) - page_size, page_size)/range(0, len(items), page_size)/' /app/pager.py

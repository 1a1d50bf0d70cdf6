#!/bin/bash
set -euo pipefail
cd /app
tr -cs 'A-Za-z' '\n' < /app/article.txt | tr 'A-Z' 'a-z' | grep -v '^$' \
  | LC_ALL=C sort | uniq -c | LC_ALL=C sort -k1,1nr -k2,2 | head -n 5 | awk '{print $1, $2}' > /app/top_words.txt

#!/bin/bash
set -euo pipefail
cd /app
cat > /app/extcount.sh <<'EOF'
#!/bin/bash
# Count regular files below $1 by extension.
find "$1" -type f -print0 | while IFS= read -r -d '' f; do
  b=${f##*/}
  core=${b#.}
  if [[ "$core" == *.* ]]; then printf '%s\n' "${b##*.}"; else printf '(none)\n'; fi
done | LC_ALL=C sort | uniq -c | awk '{c = $1; sub(/^ *[0-9]+ /, ""); print $0, c}'
EOF
chmod +x /app/extcount.sh

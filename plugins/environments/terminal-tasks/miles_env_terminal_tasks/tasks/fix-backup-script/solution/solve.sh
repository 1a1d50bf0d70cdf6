#!/bin/bash
set -euo pipefail
cd /app
cat > /app/backup.sh <<'EOF'
#!/bin/bash
# Copy every .txt file from /app/docs into /app/backup (created if missing)
# and print how many files were copied, e.g. "copied 3 files".
SRC=/app/docs
DEST=/app/backup
mkdir -p "$DEST"
count=0
for f in "$SRC"/*.txt; do
    [ -f "$f" ] || continue
    cp "$f" "$DEST/"
    count=$((count + 1))
done
echo "copied $count files"
EOF

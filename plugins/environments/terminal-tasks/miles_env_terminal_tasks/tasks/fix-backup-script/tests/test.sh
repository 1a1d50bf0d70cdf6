#!/bin/bash
# Verifier for fix-backup-script: writes 1 to /logs/verifier/reward.txt iff every check passes, else 0.
export LC_ALL=C
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
fail() { echo "FAIL: $*"; exit 0; }
# same FILE EXPECTED: byte-equal, except that a missing final newline is tolerated
same() {
  [ -f "$1" ] || fail "$1 does not exist"
  python3 -c 'import sys; a, b = (open(p, "rb").read().rstrip(b"\n") for p in sys.argv[1:]); sys.exit(a != b)' "$1" "$2" \
    || fail "$1 does not have the expected content"
}
cd /app || fail "/app is missing"
[ -f backup.sh ] || fail "backup.sh missing"
rm -rf /app/backup
printf 'q3 targets\n' > "/app/docs/q3  plan.txt"
printf 'x\n' > "/app/docs/notes.txt.bak"
out=$(cd / && timeout 20 bash /app/backup.sh 2>&1) || fail "backup.sh exited non-zero: $out"
[ "$out" = "copied 4 files" ] || fail "unexpected output: $out"
for f in "todo.txt" "meeting notes.txt" "ideas.txt" "q3  plan.txt"; do
  cmp -s "/app/docs/$f" "/app/backup/$f" || fail "$f not copied"
done
[ -e /app/backup/readme.md ] && fail "readme.md must not be copied"
[ -e /app/backup/notes.txt.bak ] && fail "notes.txt.bak must not be copied"
[ "$(ls /app/backup | wc -l)" -eq 4 ] || fail "wrong number of files in /app/backup"
echo PASS
echo 1 > /logs/verifier/reward.txt

#!/bin/bash
# Verifier for ext-counter-script: writes 1 to /logs/verifier/reward.txt iff every check passes, else 0.
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
[ -x extcount.sh ] || fail "extcount.sh missing or not executable"
d=/logs/verifier/tree; rm -rf "$d"; mkdir -p "$d/sub dir/deeper" "$d/empty" "$d/x.y"
for f in a.txt b.TXT c.tar.gz "sub dir/d.txt" Makefile .bashrc "sub dir/.env.local" "x.y/noext" \
         "sub dir/deeper/e.txt" "sub dir/deeper/f.py" "g.py" "x.y/z.tar.gz" "i j.md"; do
  printf 'x\n' > "$d/$f"
done
cat > /logs/verifier/want.txt <<'EOF'
(none) 3
TXT 1
gz 2
local 1
md 1
py 2
txt 3
EOF
got=$(cd / && timeout 20 /app/extcount.sh "$d" 2>/dev/null) || fail "script failed"
printf '%s\n' "$got" | diff - /logs/verifier/want.txt || fail "wrong output"
got2=$(cd / && timeout 20 /app/extcount.sh "$d/x.y")
[ "$got2" = "$(printf '(none) 1\ngz 1')" ] || fail "wrong output for a second directory"
echo PASS
echo 1 > /logs/verifier/reward.txt

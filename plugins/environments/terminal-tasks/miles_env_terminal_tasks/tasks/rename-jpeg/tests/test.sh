#!/bin/bash
# Verifier for rename-jpeg: writes 1 to /logs/verifier/reward.txt iff every check passes, else 0.
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
[ "$(cat "/app/photos/beach.jpg" 2>/dev/null)" = "b" ] || fail "photos/beach.jpg missing"
[ "$(cat "/app/photos/2023/party night.jpg" 2>/dev/null)" = "p" ] || fail "photos/2023/party night.jpg missing"
[ "$(cat "/app/photos/2023/cake.jpg" 2>/dev/null)" = "c" ] || fail "photos/2023/cake.jpg missing"
[ "$(cat "/app/photos/2023/dog.jpg" 2>/dev/null)" = "d" ] || fail "photos/2023/dog.jpg missing"
[ "$(cat "/app/photos/raw/img.jpeg.bak" 2>/dev/null)" = "r" ] || fail "photos/raw/img.jpeg.bak missing"
[ "$(cat "/app/photos/notes.txt" 2>/dev/null)" = "n" ] || fail "photos/notes.txt missing"
[ "$(cat "/app/photos/raw/x.png" 2>/dev/null)" = "x" ] || fail "photos/raw/x.png missing"
[ -e "/app/photos/beach.jpeg" ] && fail "photos/beach.jpeg still exists"
[ -e "/app/photos/2023/party night.jpeg" ] && fail "photos/2023/party night.jpeg still exists"
[ -e "/app/photos/2023/cake.JPEG" ] && fail "photos/2023/cake.JPEG still exists"
[ "$(find /app/photos -type f | wc -l)" -eq 7 ] || fail "wrong number of files"
echo PASS
echo 1 > /logs/verifier/reward.txt

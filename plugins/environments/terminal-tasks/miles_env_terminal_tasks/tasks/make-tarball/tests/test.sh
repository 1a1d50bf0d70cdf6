#!/bin/bash
# Verifier for make-tarball: writes 1 to /logs/verifier/reward.txt iff every check passes, else 0.
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
[ -f site-backup.tar.gz ] || fail "archive missing"
gzip -t site-backup.tar.gz 2>/dev/null || fail "not gzip-compressed"
x=/logs/verifier/extract; rm -rf "$x"; mkdir -p "$x"
tar -xzf site-backup.tar.gz -C "$x" || fail "cannot extract"
(cd "$x" && sha256sum -c --quiet /tests/SHA256SUMS) || fail "archive content differs"
[ "$(find "$x" -type f | wc -l)" -eq 4 ] || fail "unexpected extra files"
echo PASS
echo 1 > /logs/verifier/reward.txt

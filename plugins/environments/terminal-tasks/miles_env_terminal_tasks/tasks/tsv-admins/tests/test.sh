#!/bin/bash
# Verifier for tsv-admins: writes 1 to /logs/verifier/reward.txt iff every check passes, else 0.
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
same admins.txt /tests/expected.txt
echo PASS
echo 1 > /logs/verifier/reward.txt

#!/bin/bash
# Verifier for file-permissions: writes 1 to /logs/verifier/reward.txt iff every check passes, else 0.
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
mode() { stat -c %a "$1" 2>/dev/null; }
[ "$(mode secrets)" = 700 ] || fail "secrets mode $(mode secrets)"
[ "$(mode secrets/api.key)" = 600 ] || fail "api.key mode"
[ "$(mode bin/deploy.sh)" = 755 ] || fail "deploy.sh mode"
[ "$(mode bin/status.sh)" = 755 ] || fail "status.sh mode"
[ "$(mode public/index.html)" = 644 ] || fail "index.html mode"
[ "$(mode data/report.csv)" = 640 ] || fail "report.csv mode"
[ "$(cat secrets/api.key)" = "sk-test-0000" ] || fail "api.key content changed"
echo PASS
echo 1 > /logs/verifier/reward.txt

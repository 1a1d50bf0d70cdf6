#!/bin/bash
# Verifier for gzip-old-logs: writes 1 to /logs/verifier/reward.txt iff every check passes, else 0.
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
[ "$(gzip -dc /app/logs/2024-01-01.log.gz 2>/dev/null | sha256sum | cut -c1-64)" = "0a1b733ad8c216e1b7a8a9422820d4583df519e1953a80b5eecbc84f6639c0cf" ] || fail "logs/2024-01-01.log.gz"
[ -e /app/logs/2024-01-01.log ] && fail "logs/2024-01-01.log still exists"
[ "$(gzip -dc /app/logs/2024-01-02.log.gz 2>/dev/null | sha256sum | cut -c1-64)" = "d473095a20fd3ced2d9943ec7004d0e8da6e76f1169997885265aaaf944bbd29" ] || fail "logs/2024-01-02.log.gz"
[ -e /app/logs/2024-01-02.log ] && fail "logs/2024-01-02.log still exists"
[ "$(gzip -dc /app/logs/app-old.log.gz 2>/dev/null | sha256sum | cut -c1-64)" = "4476b35d3fb418ff2113de2f7dbc57e204c123706f0e2c3241ae435fefb193f4" ] || fail "logs/app-old.log.gz"
[ -e /app/logs/app-old.log ] && fail "logs/app-old.log still exists"
[ "$(sha256sum < /app/logs/current.log | cut -c1-64)" = "20c6b6da2241a4f959576ffb04ca900c188cf1416dc546942db23a4bcc34ddd3" ] || fail "current.log changed"
[ -e /app/logs/current.log.gz ] && fail "current.log must not be compressed"
[ -f /app/logs/readme.txt ] || fail "readme.txt removed"
echo PASS
echo 1 > /logs/verifier/reward.txt

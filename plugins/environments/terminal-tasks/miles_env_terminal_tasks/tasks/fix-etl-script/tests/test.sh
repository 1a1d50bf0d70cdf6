#!/bin/bash
# Verifier for fix-etl-script: writes 1 to /logs/verifier/reward.txt iff every check passes, else 0.
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
check() {  # check GOT WANT: same JSON, same key order
  python3 -c 'import json,sys; a, b = (json.load(open(p)) for p in sys.argv[1:]); sys.exit(not (a == b and list(a) == list(b)))' "$1" "$2"
}
[ -f etl/summary.json ] || fail "summary.json missing"
check etl/summary.json /tests/expected.json || fail "summary.json is wrong"
out=/logs/verifier/hidden_summary.json
(cd /logs/verifier && timeout 20 python3 /app/etl/summarize.py /tests/hidden.jsonl "$out") || fail "script fails on other input"
check "$out" /tests/hidden_expected.json || fail "wrong summary for other input"
echo PASS
echo 1 > /logs/verifier/reward.txt

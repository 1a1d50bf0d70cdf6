#!/bin/bash
# Verifier for clean-tmp-files: writes 1 to /logs/verifier/reward.txt iff every check passes, else 0.
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
[ -e "/app/workspace/a.tmp" ] && fail "workspace/a.tmp still exists"
[ -e "/app/workspace/objs/obj 1.tmp" ] && fail "workspace/objs/obj 1.tmp still exists"
[ -e "/app/workspace/old.tmp/z.tmp" ] && fail "workspace/old.tmp/z.tmp still exists"
[ -e "/app/workspace/deep/er/est/c.tmp" ] && fail "workspace/deep/er/est/c.tmp still exists"
[ -f "/app/workspace/main.c" ] || fail "workspace/main.c was deleted"
[ -f "/app/workspace/b.tmp.keep" ] || fail "workspace/b.tmp.keep was deleted"
[ -f "/app/workspace/objs/out.o" ] || fail "workspace/objs/out.o was deleted"
[ -f "/app/workspace/old.tmp/keep.txt" ] || fail "workspace/old.tmp/keep.txt was deleted"
[ -f "/app/workspace/notes.TMP" ] || fail "workspace/notes.TMP was deleted"
[ -d /app/workspace/old.tmp ] || fail "directory old.tmp was deleted"
echo PASS
echo 1 > /logs/verifier/reward.txt

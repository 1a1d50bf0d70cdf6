#!/bin/bash
# Verifier for fix-paginate: writes 1 to /logs/verifier/reward.txt iff every check passes, else 0.
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
cd /logs/verifier && PYTHONPATH=/app PYTHONDONTWRITEBYTECODE=1 python3 - <<'PY' || fail "paginate is still wrong"
from pager import paginate
assert paginate([], 3) == []
assert paginate([1, 2, 3], 3) == [[1, 2, 3]]
assert paginate([1, 2, 3, 4], 3) == [[1, 2, 3], [4]]
assert paginate(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
assert paginate([1], 1) == [[1]]
assert paginate(list("abcde"), 1) == [["a"], ["b"], ["c"], ["d"], ["e"]]
assert paginate([1, 2], 5) == [[1, 2]]
try:
    paginate([1], 0)
except ValueError:
    pass
else:
    raise AssertionError("page_size 0 must raise ValueError")
PY
echo PASS
echo 1 > /logs/verifier/reward.txt

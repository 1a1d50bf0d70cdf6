#!/bin/bash
. /tests/lib.sh
reward [ "$(cat /app/sum.txt 2>/dev/null)" = "$EXPECTED_SUM" -a -f /app/hint.txt -a "$(cat /app/count.txt 2>/dev/null)" = "$EXPECTED_LINES" ]

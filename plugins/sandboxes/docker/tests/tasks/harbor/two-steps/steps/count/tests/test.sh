#!/bin/bash
. /tests/lib.sh
reward [ "$(cat /app/count.txt 2>/dev/null)" = "$EXPECTED_LINES" ]

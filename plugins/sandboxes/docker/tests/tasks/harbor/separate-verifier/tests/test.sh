#!/bin/bash
# Runs in a fresh container built from the same Dockerfile: /app/result.txt is there only as
# the declared artifact; the agent's scratch file must not have crossed over.
want=$(sha256sum /app/input.bin | cut -d' ' -f1)
if [ "$(cat /app/result.txt 2>/dev/null)" = "$want" ] && [ ! -e /app/scratch.txt ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi

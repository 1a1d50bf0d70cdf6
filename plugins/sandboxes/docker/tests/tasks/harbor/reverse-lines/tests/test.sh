#!/bin/bash
# Harbor verifier: reward 1 iff /app/reversed.txt is /app/lines.txt reversed.
if [ -f /app/reversed.txt ] && [ "$(tac /app/lines.txt)" = "$(cat /app/reversed.txt)" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi

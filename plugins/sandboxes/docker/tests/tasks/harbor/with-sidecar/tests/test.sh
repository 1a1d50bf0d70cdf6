#!/bin/bash
want=$(python3 -c "import urllib.request; print(urllib.request.urlopen('http://cache:8080/answer', timeout=45).read().decode().strip())")
if [ "$want" = forty-two ] && [ "$(cat /app/answer.txt 2>/dev/null)" = "$want" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi

#!/bin/bash
# reward.json: the reward, and a second figure Harbor keeps beside it.
expected=100
got="$(tr -d ' \n' < /app/out/total.txt 2>/dev/null)"
if [[ "$got" == "$expected" ]]; then
  echo '{"reward": 1.0, "exact": 1}' > /logs/verifier/reward.json
elif [[ -n "$got" ]]; then
  echo "total.txt holds '$got', expected $expected"
  echo '{"reward": 0.0, "exact": 0}' > /logs/verifier/reward.json
else
  echo "no /app/out/total.txt"
  echo '{"reward": 0.0, "exact": 0}' > /logs/verifier/reward.json
fi

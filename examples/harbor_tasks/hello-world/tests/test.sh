#!/bin/bash
# Harbor's convention: the verifier writes its reward to /logs/verifier/reward.txt.
if [[ -f /app/hello.txt ]] && [[ "$(cat /app/hello.txt)" == "Hello, world!" ]]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo "hello.txt is missing or wrong: $(cat /app/hello.txt 2>&1)"
  echo 0 > /logs/verifier/reward.txt
fi

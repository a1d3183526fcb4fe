#!/bin/bash
# The reward is the fraction of the 20 expected lines the program prints right.
python3 - <<'PY'
import subprocess
expected = ["FizzBuzz" if i % 15 == 0 else "Fizz" if i % 3 == 0 else "Buzz" if i % 5 == 0 else str(i)
            for i in range(1, 21)]
try:
    out = subprocess.run(["python3", "/app/fizzbuzz.py"], capture_output=True, text=True, timeout=10).stdout
except Exception as e:
    print("could not run /app/fizzbuzz.py:", e)
    out = ""
got = out.split("\n")
right = sum(g.strip() == e for g, e in zip(got, expected))
print(f"{right} of {len(expected)} lines right")
with open("/logs/verifier/reward.txt", "w") as f:
    f.write(str(right / len(expected)))
PY

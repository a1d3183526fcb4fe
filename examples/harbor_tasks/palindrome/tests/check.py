"""Imports the answer from /app: the reward is the fraction of cases it gets right."""

import sys

sys.path.insert(0, "/app")
cases = [("racecar", True), ("Never odd or even", True), ("abc", False), ("", True), ("ab", False), ("Aa", True)]
try:
    from solution import is_palindrome
except Exception as e:  # a missing file or a syntax error scores 0
    print("cannot import solution.is_palindrome:", e)
    right = 0
else:
    right = 0
    for s, want in cases:
        try:
            ok = is_palindrome(s) is want
        except Exception as e:
            print(f"is_palindrome({s!r}) raised {e!r}")
            ok = False
        right += ok
        if not ok:
            print(f"is_palindrome({s!r}) should be {want}")
print(f"{right} of {len(cases)} right")
with open("/logs/verifier/reward.txt", "w") as f:
    f.write(str(right / len(cases)))

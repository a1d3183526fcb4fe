"""Small post-training data sets for the tiny model's alphabet (lower case, digits, + = ?)."""

from __future__ import annotations

import json
import random
from pathlib import Path


def sums(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 4), rng.randint(0, 4)
        out.append((f"{a}+{b}=", str(a + b)))
    return out


def write_sft(path: Path, n: int = 40) -> Path:
    with path.open("w") as f:
        for i, (q, a) in enumerate(sums(n)):
            if i % 2:
                row = {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            else:
                row = {"prompt": q, "completion": a}
            f.write(json.dumps(row) + "\n")
    return path


def write_pairs(path: Path, n: int = 32) -> Path:
    with path.open("w") as f:
        for i, (q, a) in enumerate(sums(n, seed=1)):
            wrong = str((int(a) + 3) % 9)
            if i % 2:
                row = {"prompt": q, "chosen": a, "rejected": wrong}
            else:
                user = {"role": "user", "content": q}
                row = {
                    "chosen": [user, {"role": "assistant", "content": a}],
                    "rejected": [user, {"role": "assistant", "content": wrong}],
                }
            f.write(json.dumps(row) + "\n")
    return path


def write_copy(path: Path, n: int = 200) -> Path:
    """``X=`` -> ``X``: SFT on these makes a tiny model that copies the digit before '=' (a teacher
    that is right when the demonstration is put there)."""
    rng = random.Random(2)
    with path.open("w") as f:
        for _ in range(n):
            x = str(rng.randint(0, 8))
            f.write(json.dumps({"prompt": f"{x}=", "completion": x}) + "\n")
    return path

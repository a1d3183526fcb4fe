"""GSM8K and MATH, read from the user's own files (or through the ``datasets`` library when it is
installed and can reach the hub or its cache). headrace downloads nothing itself.

``load_gsm8k(path, split)`` / ``load_math(path, split)`` take a ``.jsonl``, ``.json`` or
``.parquet`` file, or a directory holding ``<split>*.jsonl|json|parquet`` (as a hub repo's
config folder does, e.g. gsm8k's ``main/``). GSM8K rows have ``question`` and ``answer`` (a solution
ending in ``#### N``); MATH rows have ``problem`` and ``solution``, whose last ``\\boxed{...}``
is the answer (a row's own ``answer`` field wins, as in MATH-500).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headrace.core.errors import EnvError
from headrace.tasks.grading import extract_boxed, extract_hash

HUB = {"gsm8k": ("openai/gsm8k", "main"), "math": ("DigitalLearningGmbH/MATH-lighteval", None)}
SUFFIXES = (".jsonl", ".json", ".parquet")


class DatasetUnavailable(EnvError, ValueError):
    pass


@dataclass(frozen=True)
class MathProblem:
    question: str
    answer: str  # the reference answer alone, for ``grading.check``
    solution: str  # the worked reference solution
    meta: dict[str, Any] = field(default_factory=dict)


def _hint(name: str, problem: str) -> DatasetUnavailable:
    return DatasetUnavailable(
        f"the {name} dataset is not available: {problem}. headrace downloads nothing at run time: save the "
        f"dataset as JSONL or Parquet (for example from the hub repo {HUB[name][0]}) and pass "
        f"--set env_options.path=/path/to/file_or_dir, or install the `datasets` library with the dataset "
        f"in its cache (or the hub reachable)."
    )


def _read_file(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetUnavailable(
                f"{path} is a Parquet file, which needs pyarrow (pip install pyarrow); or convert it to JSONL"
            ) from None
        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise DatasetUnavailable(f"{path} is not JSON Lines (line {e.lineno}: {e.msg})") from None


def read_records(path: str | Path, split: str) -> list[dict]:
    """The rows of a file, or of the ``<split>*`` files of a directory, in name order."""
    path = Path(path).expanduser()
    if path.is_file():
        return _read_file(path)
    if not path.is_dir():
        raise DatasetUnavailable(f"{path} does not exist")
    files = sorted(p for p in path.glob(f"{split}*") if p.suffix in SUFFIXES)  # not recursive: one config
    if not files:
        present = sorted(p.name for p in path.iterdir())[:10]
        raise DatasetUnavailable(f"{path} holds no {split}*{{{','.join(SUFFIXES)}}} file (it has {present})")
    return [row for file in files for row in _read_file(file)]


def _from_hub(name: str, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise _hint(name, "no env_options.path was given and the `datasets` library is not installed") from None
    repo, config = HUB[name]
    try:
        return list(datasets.load_dataset(repo, config, split=split))
    except Exception as e:  # offline, gated, renamed: all mean the same to the user
        raise _hint(name, f"loading {repo} through `datasets` failed ({type(e).__name__}: {e})") from None


def _rows(name: str, path: str | Path | None, split: str, fields: Iterable[str]) -> list[dict]:
    rows = read_records(path, split) if path is not None else _from_hub(name, split)
    if not rows:
        raise DatasetUnavailable(f"the {name} {split} split read from {path or HUB[name][0]} has no rows")
    for i, row in enumerate(rows):
        if missing := [f for f in fields if f not in row]:
            raise DatasetUnavailable(f"{name} row {i} has no field(s) {missing} (it has {sorted(row)})")
    return rows


def gsm8k_answer(solution: str) -> str:
    """GSM8K's answer: what follows ``####``, without thousands separators."""
    answer = extract_hash(solution)
    if answer is None:
        raise DatasetUnavailable(f"a GSM8K answer has no '#### N' line: {solution[-80:]!r}")
    return answer.replace(",", "").strip()


def math_answer(solution: str) -> str:
    """MATH's answer: the content of the solution's last ``\\boxed{...}``."""
    answer = extract_boxed(solution)
    if answer is None:
        raise DatasetUnavailable(f"a MATH solution has no \\boxed{{...}} answer: {solution[-80:]!r}")
    return answer


def load_gsm8k(path: str | Path | None = None, split: str = "train") -> list[MathProblem]:
    return [
        MathProblem(row["question"], gsm8k_answer(row["answer"]), row["answer"])
        for row in _rows("gsm8k", path, split, ("question", "answer"))
    ]


def load_math(path: str | Path | None = None, split: str = "test") -> list[MathProblem]:
    return [
        MathProblem(
            row["problem"],
            str(row["answer"]) if row.get("answer") not in (None, "") else math_answer(row["solution"]),
            row["solution"],
            {k: row[k] for k in ("level", "type", "subject", "unique_id") if k in row},
        )
        for row in _rows("math", path, split, ("problem", "solution"))
    ]


LOADERS = {"gsm8k": load_gsm8k, "math": load_math}

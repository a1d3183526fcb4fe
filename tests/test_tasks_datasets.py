"""GSM8K and MATH loaders over files the tests write, the `datasets` path, and the errors."""

from __future__ import annotations

import json
import sys
import types

import pytest

from headrace.tasks.datasets import DatasetUnavailable, load_gsm8k, load_math
from headrace.tasks.grading import grade

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A shop sells 1,000 pens a day for 2 days.", "answer": "1000 * 2 = 2000\n#### 2,000"},
]
MATH_ROWS = [
    {"problem": "1/2 + 1/4?", "solution": "We get $\\boxed{\\frac{3}{4}}$.", "level": "Level 1", "type": "Algebra"},
    {"problem": "Simplify.", "solution": "First \\boxed{2}, then finally $\\boxed{\\{1, \\{2\\}\\}}$."},
    {"problem": "MATH-500 style", "solution": "... \\boxed{5}", "answer": "5", "unique_id": "test/x.json"},
]


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_gsm8k_from_jsonl(tmp_path):
    problems = load_gsm8k(_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS))
    assert [p.answer for p in problems] == ["7", "2000"]
    assert problems[0].question.startswith("Tom") and problems[0].solution.endswith("#### 7")
    assert grade("so 2,000 pens", problems[1].answer).correct


def test_math_from_a_directory_of_split_files(tmp_path):
    (tmp_path / "data").mkdir()
    _jsonl(tmp_path / "data" / "test-00000-of-00001.jsonl", MATH_ROWS)
    _jsonl(tmp_path / "data" / "train-00000-of-00001.jsonl", MATH_ROWS[:1])
    problems = load_math(tmp_path / "data", split="test")
    assert [p.answer for p in problems] == ["\\frac{3}{4}", "\\{1, \\{2\\}\\}", "5"]
    assert problems[0].meta == {"level": "Level 1", "type": "Algebra"}
    assert problems[2].meta == {"unique_id": "test/x.json"}
    assert len(load_math(tmp_path / "data", split="train")) == 1
    with pytest.raises(DatasetUnavailable, match="holds no validation"):
        load_math(tmp_path / "data", split="validation")


def test_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        path.write_bytes(b"PAR1")
        with pytest.raises(DatasetUnavailable, match="needs pyarrow"):
            load_gsm8k(path)
        return
    pq.write_table(pyarrow.Table.from_pylist(GSM8K_ROWS), path)
    assert [p.answer for p in load_gsm8k(path)] == ["7", "2000"]


def test_bad_files_say_what_is_wrong(tmp_path):
    with pytest.raises(DatasetUnavailable, match="does not exist"):
        load_gsm8k(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetUnavailable, match=r"row 0 has no field\(s\) \['answer'\]"):
        load_gsm8k(_jsonl(tmp_path / "a.jsonl", [{"question": "q", "solution": "s"}]))
    with pytest.raises(DatasetUnavailable, match="no '#### N' line"):
        load_gsm8k(_jsonl(tmp_path / "b.jsonl", [{"question": "q", "answer": "7"}]))
    with pytest.raises(DatasetUnavailable, match="no \\\\boxed"):
        load_math(_jsonl(tmp_path / "c.jsonl", [{"problem": "p", "solution": "it is 7"}]))
    (tmp_path / "d.jsonl").write_text("{not json\n")
    with pytest.raises(DatasetUnavailable, match="not JSON Lines"):
        load_gsm8k(tmp_path / "d.jsonl")
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(DatasetUnavailable, match="has no rows"):
        load_gsm8k(tmp_path / "e.jsonl")


def test_without_a_path_or_the_datasets_library_the_error_says_how(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(DatasetUnavailable) as caught:
        load_gsm8k()
    message = str(caught.value)
    assert "downloads nothing at run time" in message and "env_options.path=" in message
    assert "openai/gsm8k" in message and "\n" not in message


def test_the_datasets_library_is_used_when_it_works_and_explained_when_offline(monkeypatch):
    calls = []

    def load_dataset(repo, config, split):
        calls.append((repo, config, split))
        if repo == "openai/gsm8k":
            return GSM8K_ROWS
        raise ConnectionError("Couldn't reach 'DigitalLearningGmbH/MATH-lighteval' on the Hub")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert [p.answer for p in load_gsm8k(split="test")] == ["7", "2000"]
    with pytest.raises(DatasetUnavailable, match=r"ConnectionError: Couldn't reach .*env_options\.path="):
        load_math()
    assert calls == [("openai/gsm8k", "main", "test"), ("DigitalLearningGmbH/MATH-lighteval", None, "test")]

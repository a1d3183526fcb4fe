"""Math answer extraction and grading: tricky spellings, math-verify on the main thread, on an
event loop and on worker threads, and the pure-Python fallback without it."""

from __future__ import annotations

import threading
import time

import pytest

from headrace.tasks import grading
from headrace.tasks.grading import extract_answer, extract_boxed, grade, grade_async, parse_number

# (response, gold, correct): numbers as models write them
NUMERIC = [
    ("so the answer is \\boxed{\\frac{1}{2}}.", "0.5", True),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", True),
    ("\\boxed{\\frac34}", "3/4", True),
    ("We get \\boxed{1,000}", "1000", True),
    ("... 10 + 62 = 72\n#### 72", "72", True),
    ("blah #### 1,234", "1234", True),
    ("The total is $18.", "18", True),
    ("She pays $1,234.50 in total", "1234.5", True),
    ("that is 50%", "50", True),
    ("that is 50%", "0.5", True),
    ("\\boxed{50\\%}", "50", True),
    ("It was −5 degrees", "-5", True),
    ("\\boxed{\\text{18 dollars}}", "18", True),
    ("\\boxed{18 \\text{ cm}}", "18", True),
    ("\\boxed{x = 3}", "3", True),
    ("\\boxed{90^\\circ}", "90", True),
    ("\\boxed 5", "5", True),
    ("3 / 4 of them", "0.75", True),
    ("0.333333", "1/3", True),
    ("5.0", "5", True),
    ("first 12, then 13", "12", False),  # the last number counts
    ("0.33", "1/3", False),
    ("\\boxed{72} though maybe 71", "71", False),  # the box wins over the last number
    ("\\boxed{1,2}", "12", False),  # not a thousands separator
    ("1" + "0" * 400, "5", False),  # beyond floats
    ("no number here", "5", False),
    ("", "5", False),
]

SYMBOLIC = [
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}2", True),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", True),
    ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", True),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", True),
    ("\\boxed{2x+2}", "2(x+1)", True),
    ("\\boxed{\\frac{\\sqrt{3}}{3}}", "\\frac{\\sqrt3}2", False),
    ("\\boxed{3\\pi}", "2\\pi", False),
]


@pytest.mark.parametrize("response, gold, correct", NUMERIC)
def test_numeric_answers(response, gold, correct):
    assert grade(response, gold).correct is correct


@pytest.mark.parametrize("response, gold, correct", NUMERIC)
def test_numeric_answers_need_no_math_verify(monkeypatch, response, gold, correct):
    monkeypatch.setattr(grading, "math_verify", None)
    assert grade(response, gold).correct is correct


@pytest.mark.parametrize("response, gold, correct", SYMBOLIC)
def test_symbolic_answers(response, gold, correct):
    pytest.importorskip("math_verify")
    result = grade(response, gold)
    assert result.correct is correct, result


def test_extraction_rules():
    assert extract_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b \\boxed{\\left\\{x\\right\\}}") == "\\left\\{x\\right\\}"
    assert extract_boxed("\\boxed{unclosed {") is None
    assert extract_boxed("\\fbox{7}") == "7"
    assert extract_boxed("\\boxed{\\boxed{1}+1}") == "1"  # the last box to open
    assert extract_boxed("\\boxed{2} \\boxed 3$") == "3"
    assert extract_answer("x #### 5\n#### 6 apples") == ("6 apples", "hash")
    assert extract_answer("I think 3, no, 4.") == ("4", "last_number")
    assert extract_answer("The answer is 12 apples.", ("answer_is",)) == ("12 apples", "answer_is")
    assert extract_answer("nothing") == (None, "none")
    with pytest.raises(ValueError, match="unknown answer extraction method 'box'"):
        extract_answer("x", ("box",))
    assert parse_number("12%") == {12, parse_number("0.12").pop()}
    assert parse_number("x+1") is None


def test_without_math_verify_symbolic_answers_are_only_compared_as_strings(monkeypatch):
    monkeypatch.setattr(grading, "math_verify", None)
    assert grade("\\boxed{\\dfrac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}").correct  # same after normalising
    result = grade("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}2")
    assert (result.correct, result.checker) == (False, "none")


@pytest.mark.timeout(30)
def test_runaway_answers_are_refused_fast_on_every_thread():
    pytest.importorskip("math_verify")
    results = {}

    def run(key):
        start = time.perf_counter()
        results[key] = grade("\\boxed{9^{9^{9}}}", "5"), time.perf_counter() - start

    run("main")
    worker = threading.Thread(target=run, args=("worker",))
    worker.start()
    worker.join(20)
    for key in ("main", "worker"):
        result, seconds = results[key]
        assert (result.correct, result.checker) == (False, "refused") and seconds < 1, (key, result, seconds)


def test_math_verify_works_on_worker_threads():
    """math-verify's signal-based timeout raises off the main thread; grading must not."""
    pytest.importorskip("math_verify")
    results = []
    worker = threading.Thread(target=lambda: results.append(grade("\\boxed{\\pi/2}", "\\frac{\\pi}{2}")))
    worker.start()
    worker.join(20)
    assert results and results[0].correct and results[0].checker == "math_verify"


async def test_grading_from_the_event_loop_and_off_it():
    pytest.importorskip("math_verify")
    on_loop = grade("\\boxed{\\pi/2}", "\\frac{\\pi}{2}")  # main thread, inside a running loop
    off_loop = await grade_async("\\boxed{\\pi/2}", "\\frac{\\pi}{2}")
    assert on_loop.correct and off_loop.correct and off_loop.checker == "math_verify"

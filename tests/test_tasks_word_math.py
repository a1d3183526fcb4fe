"""Generated word problems: deterministic, exact, disjoint splits, a difficulty that means something."""

from __future__ import annotations

import re
import statistics

import pytest

from headrace.tasks.grading import grade
from headrace.tasks.word_math import LEVELS, TEMPLATES, Difficulty, generate, split_of

_LINE = re.compile(r": (\d+) ([-+x/]) (\d+) = (\d+)\.$")
_OPS = {"+": int.__add__, "-": int.__sub__, "x": int.__mul__, "/": int.__floordiv__}


def test_same_arguments_same_problem_and_seeds_differ():
    assert generate(7, seed=3, difficulty=2) == generate(7, seed=3, difficulty=2)
    questions = {generate(i, seed=s).question for s in range(3) for i in range(20)}
    assert len(questions) > 55


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_solutions_are_exact_and_end_with_the_answer(level):
    for i in range(150):
        problem = generate(i, seed=1, difficulty=level)
        lines = problem.solution.splitlines()
        assert lines[-1] == f"#### {problem.answer}" and problem.answer >= 0
        assert len(lines) - 1 == problem.steps
        for line in lines[:-1]:  # every worked line is right, and divisions leave no remainder
            a, op, b, result = _LINE.search(line).groups()
            a, b, result = int(a), int(b), int(result)
            assert _OPS[op](a, b) == result and (op != "/" or a % b == 0), line
        assert str(problem.answer) in lines[-2] and grade(problem.solution, str(problem.answer)).correct


def test_difficulty_sets_steps_and_number_sizes():
    def stats(level):
        problems = [generate(i, seed=2, difficulty=level) for i in range(200)]
        numbers = [int(n) for p in problems for n in re.findall(r"\d+", p.question)]
        p90 = statistics.quantiles(numbers, n=10)[-1]  # totals (a trip's length, a bill) may exceed max_value
        return statistics.mean(p.steps for p in problems), p90, {p.template for p in problems}

    (steps1, p90_1, templates1), (steps5, p90_5, templates5) = stats(1), stats(5)
    assert steps1 <= 2.1 and steps5 >= 7.5
    assert p90_1 <= LEVELS[1].max_value and p90_5 > 200
    assert templates1 == templates5 == set(TEMPLATES)
    custom = generate(0, difficulty=Difficulty(steps=5, max_value=30))
    assert custom.steps >= 4
    with pytest.raises(ValueError, match="difficulty must be a level in 1-5"):
        generate(0, difficulty=9)
    with pytest.raises(ValueError, match="unknown word_math template"):
        generate(0, templates=("poetry",))


def test_held_out_split_never_overlaps_train():
    train = {generate(i, seed=s, difficulty=1, split="train").question for s in range(2) for i in range(1500)}
    test = {generate(i, seed=s, difficulty=1, split="test").question for s in range(2) for i in range(300)}
    assert len(test) > 250  # level 1 is a small space, but not a handful of problems
    assert not train & test
    assert all(split_of(q) == "test" for q in test) and all(split_of(q) == "train" for q in train)
    assert generate(0, split="test").split == "test"

"""The code task: finding the code in a reply, grading it on hidden tests in the sandbox (right,
wrong, partial, syntax error, infinite loop, exception...), the generated problems and their
splits, the env single- and multi-turn driven by hand, and `headrace run` on sim (a subprocess)
and on the tiny torch model."""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
import subprocess
import sys

import anyio
import pytest

from headrace.envs.context import EnvContext
from headrace.tasks.code_env import CodeEnv, make_code, make_code_multi_turn
from headrace.tasks.code_grading import complete_body, extract_code, feedback, run_tests
from headrace.tasks.code_problems import BARE_FAMILIES, FAMILIES, TEMPLATES, Case, generate
from headrace.tokenizers.char import CharTokenizer
from tests.env_helpers import chatml_renderer, drive, run_config, tiny_renderer

TESTS = [Case("add(1)", "4"), Case("add(2)", "5"), Case("add(-3)", "0")]


def _block(body: str) -> str:
    return f"Here it is:\n```python\n{body}\n```\nIt adds three."


async def _grade(body: str, per_test_cpu_s: float = 0.3):
    code = extract_code(_block(body), "add")
    assert code is not None
    return await run_tests(code, "add", TESTS, per_test_cpu_s)


# ---- graders ----


async def test_right_wrong_and_partial_answers_get_the_fraction_of_tests_passed():
    right = await _grade("def add(x):\n    return x + 3")
    wrong = await _grade("def add(x):\n    return x + 2")
    partial = await _grade("def add(x):\n    return 4 if x == 1 else x")
    assert (right.fraction, wrong.fraction, partial.fraction) == (1.0, 0.0, pytest.approx(1 / 3))
    assert partial.outcomes == (("pass",), ("fail", "2"), ("fail", "-3"))
    assert (right.seconds > 0 or right.cached) and not right.timed_out and right.module_error is None
    assert "add(2) returned 2, expected 5." in feedback(partial, TESTS)


async def test_a_syntax_error_or_a_missing_function_is_caught_before_any_sandbox_call():
    broken = await _grade("def add(x)\n    return x + 3")
    assert broken.syntax_error is not None and broken.syntax_error.startswith("SyntaxError") and broken.seconds == 0
    missing = await _grade("def plus(x):\n    return x + 3")
    assert missing.missing_function and missing.fraction == 0 and missing.seconds == 0
    assert "does not compile" in feedback(broken, TESTS) and "does not define" in feedback(missing, TESTS)


async def test_an_infinite_loop_fails_its_tests_and_not_the_run():
    looping = await _grade("def add(x):\n    while x == 2:\n        pass\n    return x + 3")
    assert looping.outcomes == (("pass",), ("timeout",), ("pass",)) and looping.timed_out
    assert "add(2) did not finish in time." in feedback(looping, TESTS)
    asleep = await _grade("import time\ndef add(x):\n    time.sleep(60)", per_test_cpu_s=0.1)
    assert asleep.killed == "wall" and asleep.outcomes == () and asleep.timed_out  # no CPU used: the wall limit


async def test_exceptions_exit_and_output_floods_are_contained():
    raising = await _grade("def add(x):\n    return 1 / (x - 2) and x + 3")
    assert raising.outcomes[1] == ("error", "ZeroDivisionError: division by zero") and raising.passed == 2
    exiting = await _grade("import sys\ndef add(x):\n    return x + 3\nsys.exit(1)")
    assert exiting.fraction == 1.0 and exiting.module_error == "SystemExit: 1"
    flooding = await _grade("def add(x):\n    print('x' * 10**6)\n    return x + 3")
    assert flooding.fraction == 1.0  # the answer's own output never reaches the harness's pipe


async def test_same_value_means_same_type_so_an_eq_override_or_a_bool_passes_nothing():
    cheat = await _grade(
        "class A(int):\n    def __eq__(self, other):\n        return True\ndef add(x):\n    return A(0)"
    )
    boolean = await _grade("def add(x):\n    return True")
    assert cheat.fraction == 0.0 and boolean.fraction == 0.0
    as_float = await run_tests("def half(x):\n    return x / 2", "half", [Case("half(3)", "1.5")])
    int_for_float = await run_tests("def two():\n    return 2", "two", [Case("two()", "2.0")])
    assert as_float.fraction == 1.0 and int_for_float.fraction == 1.0


async def test_the_same_answer_is_graded_once_unless_it_timed_out():
    code = "def add(x):\n    return x + 3  # graded once"
    first, *others = [None] * 4

    async def grade(i: int) -> None:
        nonlocal first
        graded = await run_tests(code, "add", TESTS)
        if i == 0:
            first = graded
        else:
            others[i - 1] = graded

    async with anyio.create_task_group() as tg:  # a group's members answering alike, at once
        for i in range(4):
            tg.start_soon(grade, i)
    calls = [g for g in [first, *others] if not g.cached]
    assert len(calls) == 1 and calls[0].seconds > 0 and all(g.fraction == 1.0 for g in [first, *others])
    looping = "def add(x):\n    while True:\n        pass  # not remembered"
    again = [await run_tests(looping, "add", TESTS[:1], 0.1) for _ in range(2)]
    assert [g.cached for g in again] == [False, False] and all(g.timed_out for g in again)


def test_the_code_is_found_in_fences_bare_defs_and_cut_off_blocks():
    two_blocks = "```python\ndef add(x):\n    return x + 3\n```\nUse it:\n```python\nprint(add(2))\n```"
    assert extract_code(two_blocks, "add") == "def add(x):\n    return x + 3\n"  # the block that defines it
    prose_after = "def add(x):\n    return x + 3\n\nThis function adds 3 to x."
    assert extract_code(prose_after, "add") == "def add(x):\n    return x + 3\n"
    cut_off = "```python\ndef add(x):\n    return x + 3"
    assert extract_code(cut_off, "add") == "def add(x):\n    return x + 3"
    indented = "Answer:\n    def add(x):\n        return x + 3"
    assert extract_code(indented, "add") == "def add(x):\n    return x + 3"
    assert extract_code("The answer is x plus three.", "add") is None
    assert complete_body("def f(x): return ", "x+3 and yq:") == "def f(x): return x+3 and yq"
    assert complete_body("def f(x): return ", "7)q") == "def f(x): return 7"


# ---- problems ----


def test_problems_are_deterministic_and_the_splits_share_no_problem():
    assert generate(5) == generate(5) and generate(5) != generate(6)
    keys = {}
    for split in ("train", "test"):
        for i in range(400):
            p = generate(i, split=split)
            assert p.split == split and len(p.tests) >= 1
            keys.setdefault(split, set()).add((p.family, p.says))
    assert not keys["train"] & keys["test"]
    test_families = [generate(i, split="test").family for i in range(10)]
    assert test_families == list(FAMILIES) * 2  # the families in turn: any prefix of the eval is balanced


def test_every_template_is_drawn_in_one_split_or_both_with_examples_that_are_not_tests():
    for family in FAMILIES:
        seen: dict[str, set[str]] = {"train": set(), "test": set()}
        for split in seen:
            for i in range(300):
                p = generate(i * len(FAMILIES), split=split, families=(family,), tests=5, examples=1)
                seen[split].add(p.template)
                assert not {t.call for t in p.examples} & {t.call for t in p.tests}
                assert 1 <= len(p.tests) <= 5 and (len(p.tests) == 1) == (not p.params) or family != "arithmetic"
        templates = {s.function for s in TEMPLATES[family](random.Random(0))}
        assert seen["train"] | seen["test"] == templates and len(seen["train"]) >= len(templates) - 4


async def test_each_bare_expression_passes_its_own_hidden_tests():
    """The tiny form's reference bodies are written by hand: each must agree with its solver."""
    problems = {}
    for i in range(300):
        p = generate(i, families=BARE_FAMILIES, bare=True)
        problems.setdefault(p.template + p.family, p)
    assert len(problems) >= 14
    for p in problems.values():
        assert p.function == "f" and p.examples == () and set(p.expression) <= set(CharTokenizer().id_to_token[4:])
        graded = await run_tests(f"def f({', '.join(p.params)}): return {p.expression}", "f", p.tests)
        assert graded.fraction == 1.0, (p, graded)


# ---- the env ----


def _ctx(renderer, **options) -> EnvContext:
    tokenizer = getattr(renderer, "tok", None) or CharTokenizer()
    if renderer.name == "chat_template":
        from headrace.tokenizers.hf import HFTokenizer

        tokenizer = HFTokenizer(renderer.hf)
    return EnvContext(
        tokenizer=tokenizer,
        group_size=2,
        batch_size=3,
        steps=4,
        seed=0,
        max_tokens=64,
        options=options,
        model="tiny" if renderer.name == "tiny" else "./chat",
        renderer_name=renderer.name,
    )


def _problem():
    return dataclasses.replace(generate(0, families=("arithmetic",)), function="add", params=("x",), tests=tuple(TESTS))


async def test_single_turn_reward_is_the_pass_fraction_with_the_metrics():
    r = chatml_renderer()
    env = CodeEnv(_problem(), r, 64)
    _, _, results = await drive(env, r, [_block("def add(x):\n    return x + 3 if x != 2 else 0")])
    assert results[-1].done and results[-1].reward == pytest.approx(2 / 3)
    m = results[-1].metrics
    assert m["pass_fraction"] == pytest.approx(2 / 3) and m["correct"] == 0.0 and m["syntax_error"] == 0.0
    assert m["sandbox_calls"] == 1.0 and m["sandbox_s"] > 0 and m["format_ok"] == 1.0
    env = CodeEnv(_problem(), r, 64)
    _, _, results = await drive(env, r, ["I cannot write code."])
    assert results[-1].reward == 0.0 and results[-1].metrics["no_code"] == 1.0


async def test_multi_turn_shows_the_test_report_and_pays_the_last_attempt():
    r = chatml_renderer()
    env = CodeEnv(_problem(), r, 64, turns=3)
    replies = [_block("def add(x):\n    return x + 2"), _block("def add(x):\n    return x + 3")]
    observations, actions, results = await drive(env, r, replies)
    assert len(results) == 2 and not results[0].done and results[0].reward == 0.0
    shown = r.hf.decode(observations[1][len(observations[0]) + len(actions[0].tokens) :])
    assert "0 of 3 tests passed" in shown and "add(2) returned 4, expected 5." in shown
    assert observations[1][: len(observations[0])] == observations[0]  # token in / token out
    last = results[1]
    assert last.done and last.reward == 1.0
    assert (last.metrics["attempts"], last.metrics["first_pass_fraction"], last.metrics["fixed"]) == (2.0, 0.0, 1.0)


async def test_multi_turn_ends_at_the_turn_limit_on_the_last_attempts_fraction():
    r = chatml_renderer()
    env = CodeEnv(_problem(), r, 64, turns=2)
    replies = [_block("def add(x):\n    return x + 3 if x != 2 else 0"), _block("def add(x)\n  oops")]
    _, _, results = await drive(env, r, replies)
    assert len(results) == 2 and results[-1].done and results[-1].reward == 0.0  # it broke what worked
    assert results[-1].metrics["syntax_error"] == 1.0 and results[-1].metrics["first_pass_fraction"] == pytest.approx(
        2 / 3
    )


async def test_the_tiny_model_gets_the_bare_form():
    r = tiny_renderer()
    dataset = make_code(_ctx(r))
    env = (await dataset.get_batch(0)[0].make_envs())[0]
    assert isinstance(env, CodeEnv) and env.problem.family in BARE_FAMILIES
    observation, _ = await env.initial_observation()
    assert r.tok.decode(observation).endswith(f"def f({', '.join(env.problem.params)}): return ")
    _, _, results = await drive(env, r, [env.problem.expression])
    assert results[-1].reward == 1.0


def test_options_are_checked_and_the_eval_split_is_held_out():
    r = chatml_renderer()
    with pytest.raises(ValueError, match="did you mean 'families'"):
        make_code(_ctx(r, familes="lists"))
    with pytest.raises(ValueError, match="unknown code families"):
        make_code(_ctx(r, families="lists,graphs"))
    with pytest.raises(ValueError, match="alphabet lacks"):
        make_code(_ctx(tiny_renderer(), families="strings"))
    test = make_code(_ctx(r, split="test", eval_size=10))
    assert len(test) == 4 and all(b.kwargs["problem"].split == "test" for b in test.get_batch(0))
    multi = make_code_multi_turn(_ctx(r, families="lists"))
    builder = multi.get_batch(0)[0]
    assert builder.kwargs["turns"] == 3 and builder.tags == ("code_multi_turn", "lists")
    clone = pickle.loads(pickle.dumps(builder))
    assert clone.kwargs["problem"] == builder.kwargs["problem"]


# ---- through the engine ----


@pytest.mark.parametrize("env", ["code", "code_multi_turn"])
def test_headrace_run_on_sim_in_a_subprocess(tmp_path, env):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "headrace", "run", "--backend", "sim", "--env", env, "--steps", "2"]
    cmd += ["--batch-size", "2", "--group-size", "4", "--run-dir", str(run_dir), "--no-progress"]
    cmd += ["--set", "advantages.filter_constant=false", "--set", "eval.every=2", "--set", "eval.problems=4"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    last = rows[-1]
    assert 0.0 <= last["env/all/pass_fraction"] <= 1.0 and last["env/all/sandbox_calls"] >= 0
    assert f"env/{env}/syntax_error" in last and "env/all/timeout" in last
    assert f"eval/{env}/accuracy" in last and last[f"eval/{env}/problems"] == 4
    if env == "code_multi_turn":
        assert 1.0 <= last["env/all/attempts"] <= 3.0


@pytest.mark.slow
async def test_two_steps_on_the_tiny_torch_model(tmp_path):
    pytest.importorskip("torch")
    from headrace.run.train import train

    summary = await train(run_config(tmp_path, "code", "torch", {"families": "constant"}))
    assert summary.steps == 2
    assert all("env/all/pass_fraction" in row and "optim/loss" in row for row in summary.metrics)


def test_no_sandbox_call_blocks_the_loop_for_long():
    """A loop in an answer runs in the child: the event loop keeps serving other work meanwhile."""

    async def main() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await anyio.sleep(0.01)
                ticks += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            await run_tests("def add(x):\n    while True: pass", "add", TESTS[:1], 0.3)
            tg.cancel_scope.cancel()
        return ticks

    assert anyio.run(main) >= 10

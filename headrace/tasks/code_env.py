"""``code`` and ``code_multi_turn``: write a Python function from a specification; hidden unit
tests run in the sandbox and the reward is the fraction passed.

The problems are generated (``code_problems``: families ``constant``, ``arithmetic``,
``strings``, ``lists``, ``algorithms``, in rising difficulty); the grading is ``code_grading``
(one sandbox call per answer, each test under a CPU-time alarm). On a chat model the prompt is
the specification, one worked example and "answer in a ```python block"; on the embedded tiny
model (``completion_or_chat``) it is the bare completion ``f returns x plus 3. def f(x): return``
and the reply is the body (only ``constant`` and ``arithmetic`` can be written in its alphabet).

``code_multi_turn`` (or ``code`` with ``turns=N``): after a failed attempt the next observation
is the test report (the compile error, or which tests failed with the value returned or the
exception raised, cut to ``feedback_chars``) and the model answers again, up to ``turns``
attempts. The reward is the last attempt's pass fraction: what the model finally hands over,
so a later attempt that breaks what worked is paid for, and one that fixes it is paid in full.

Options (``--set env_options.NAME=VALUE``): ``split`` (``train``; ``test``: the held-out
problems, each of the first ``eval_size`` (200) once, the families in turn), ``families``
(comma-separated; default all five on a chat model, ``constant,arithmetic`` bare), ``tests``
(5 hidden tests a problem; a constant has one), ``examples`` (1 shown in the prompt), ``turns``
(1; ``code_multi_turn``: 3), ``feedback_chars`` (600), ``format_coef`` (0.0: what an answer cut
off at ``max_tokens``, without code, or that does not compile costs), ``per_test_cpu_s`` (0.5).

Metrics (of the last attempt): ``pass_fraction``, ``correct`` (every test passed: the eval's
accuracy), ``syntax_error``, ``no_code``, ``missing_function``, ``timeout``, ``module_error``,
``format_ok``; ``attempts``, ``first_pass_fraction``, ``fixed`` (failed first, passed last);
``sandbox_s`` (seconds in sandbox calls, all attempts), ``sandbox_calls`` and ``graded_before``
(answers graded from an identical earlier one, no call). Per family under
``env/<family>/``.
"""

from __future__ import annotations

from collections.abc import Sequence

from headrace.core.types import RLDataset
from headrace.envs.base import GroupOf, ProblemDataset
from headrace.envs.context import EnvContext
from headrace.envs.message import MessageEnv, MessageStep, PlainText, completion_or_chat
from headrace.plugins.registry import register_env
from headrace.renderers import Message, Renderer
from headrace.tasks.code_grading import PER_TEST_CPU_S, Graded, complete_body, extract_code, feedback, run_tests
from headrace.tasks.code_problems import BARE_FAMILIES, FAMILIES, CodeProblem, generate
from headrace.tasks.problem_sets import ListDataset

OPTIONS = {
    "split": "train",
    "families": "",
    "tests": 5,
    "examples": 1,
    "turns": 1,
    "eval_size": 200,
    "feedback_chars": 600,
    "format_coef": 0.0,
    "per_test_cpu_s": PER_TEST_CPU_S,
}
AGAIN = "Fix the function and answer with the whole function in a ```python code block."


def chat_prompt(problem: CodeProblem) -> str:
    call = f"{problem.function}({', '.join(problem.params)})"
    shown = " ".join(f"For example, {t.call} returns {t.expected}." for t in problem.examples)
    return (
        f"Write a Python function {call} that {problem.says}. {shown + ' ' if shown else ''}"
        "Answer with the function in a ```python code block."
    )


def bare_stub(problem: CodeProblem) -> str:
    return f"def f({', '.join(problem.params)}): return "


class CodeEnv(MessageEnv):
    def __init__(
        self,
        problem: CodeProblem,
        renderer: Renderer,
        max_tokens: int,
        turns: int = 1,
        feedback_chars: int = 600,
        format_coef: float = 0.0,
        per_test_cpu_s: float = PER_TEST_CPU_S,
    ):
        super().__init__(renderer, max_tokens, max_turns=turns)
        self.problem, self.feedback_chars, self.format_coef = problem, feedback_chars, format_coef
        self.per_test_cpu_s = per_test_cpu_s
        self.bare = renderer.name == PlainText.name
        self.first: float | None = None
        self.sandbox_s = 0.0
        self.sandbox_calls = self.cached = 0

    def initial_messages(self) -> Sequence[Message]:
        self.first, self.sandbox_s, self.sandbox_calls, self.cached = None, 0.0, 0, 0
        p = self.problem
        text = f"f {p.says}. {bare_stub(p)}" if self.bare else chat_prompt(p)
        return [{"role": "user", "content": text}]

    async def grade(self, text: str) -> Graded:
        p = self.problem
        code = complete_body(bare_stub(p), text) if self.bare else extract_code(text, p.function)
        if code is None:
            return Graded(len(p.tests), no_code=True)
        graded = await run_tests(code, p.function, p.tests, self.per_test_cpu_s)
        self.sandbox_s += graded.seconds
        self.sandbox_calls += graded.seconds > 0
        self.cached += graded.cached
        return graded

    async def respond(self, text: str, clean: bool) -> MessageStep:
        graded = await self.grade(text)
        if self.first is None:
            self.first = graded.fraction
        all_passed = graded.passed == graded.total
        if not all_passed and not self.last_turn:
            report = feedback(graded, self.problem.tests, self.feedback_chars)
            return MessageStep(messages=[f"{report}\n{AGAIN}"], metrics={"attempt_pass_fraction": graded.fraction})
        format_ok = float(clean and not graded.no_code and graded.syntax_error is None)
        metrics = {
            "pass_fraction": graded.fraction,
            "correct": float(all_passed),
            "syntax_error": float(graded.syntax_error is not None),
            "no_code": float(graded.no_code),
            "missing_function": float(graded.missing_function),
            "timeout": float(graded.timed_out),
            "module_error": float(graded.module_error is not None),
            "format_ok": format_ok,
            "attempts": float(self.turns),
            "first_pass_fraction": self.first,
            "fixed": float(all_passed and self.first < 1.0),
            "sandbox_s": self.sandbox_s,
            "sandbox_calls": float(self.sandbox_calls),
            "graded_before": float(self.cached),
        }
        reward = graded.fraction + self.format_coef * (format_ok - 1.0)
        return MessageStep(reward, done=True, metrics=metrics)


def _dataset(env: str, ctx: EnvContext) -> RLDataset:
    options = ctx.options
    renderer = completion_or_chat(ctx)
    bare = renderer.name == PlainText.name
    named = tuple(f.strip() for f in options["families"].split(",") if f.strip())
    families = named or (BARE_FAMILIES if bare else FAMILIES)
    if options["tests"] < 1 or options["examples"] < 0 or options["turns"] < 1:
        raise ValueError(f"the {env} env needs tests >= 1, examples >= 0 and turns >= 1 (got {options})")

    def problem(index: int, split: str) -> CodeProblem:
        return generate(index, split=split, families=families, tests=options["tests"], examples=options["examples"],
                        bare=bare)  # fmt: skip

    def group(p: CodeProblem) -> GroupOf:
        kwargs = {
            "problem": p,
            "renderer": renderer,
            "max_tokens": ctx.max_tokens,
            "turns": options["turns"],
            "feedback_chars": options["feedback_chars"],
            "format_coef": options["format_coef"],
            "per_test_cpu_s": options["per_test_cpu_s"],
        }
        return GroupOf(CodeEnv, kwargs, ctx.group_size, tags=(env, p.family))

    problem(0, options["split"])  # a wrong family fails here, not in a rollout
    if options["split"] == "test":
        return ListDataset([problem(i, "test") for i in range(options["eval_size"])], group, ctx.batch_size)
    return ProblemDataset(lambda rng: group(problem(rng.getrandbits(48), "train")), ctx.batch_size,
                          max(ctx.steps, 1), ctx.seed)  # fmt: skip


@register_env("code", options=OPTIONS)
def make_code(ctx: EnvContext) -> RLDataset:
    """Write a Python function from a spec; reward = the fraction of hidden unit tests passed (sandboxed)."""
    return _dataset("code", ctx)


@register_env("code_multi_turn", options={**OPTIONS, "turns": 3})
def make_code_multi_turn(ctx: EnvContext) -> RLDataset:
    """The code task with the test report shown after a failed attempt, up to env_options.turns (3) tries."""
    return _dataset("code_multi_turn", ctx)


__all__ = ["CodeEnv", "chat_prompt", "make_code", "make_code_multi_turn"]

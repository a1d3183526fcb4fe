"""``tool_calc``: multi-turn tool use on :class:`~headrace.envs.message.MessageEnv`.

The model is asked to compute an expression such as ``483*27+1906`` and has a calculator: a
reply holding ``<calc>EXPRESSION</calc>`` is a tool call. The env evaluates the expression in
the tool sandbox (``sandbox.run_tool``: a subprocess with CPU, memory and wall-clock limits and
no network) and answers with a ``tool`` message holding the result, or ``error: ...``. A reply
without a call is the final answer, graded on its last number (or ``\\boxed{}``): reward 1 when
right. ``max_turns`` assistant turns at most; the last one is graded as the answer (a call in it
counts for nothing).

Options: ``digits`` (3: the size of the operands), ``terms`` (3), ``max_turns`` (4),
``tool_role`` (``tool``; ``user`` for a chat template that knows no tool role), ``few_shot``
(false; true shows one worked exchange first: SmolLM2-135M calls no tool without it), ``split``
(``train``; ``test``: the held-out expressions, chosen by a hash of their text, each of the
first ``eval_size`` (200) once).

Metrics: ``correct``, ``tool_calls`` and ``tool_errors`` per episode, ``turn_limit``.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Sequence

from headrace.core.types import RLDataset
from headrace.envs.base import GroupOf, ProblemDataset
from headrace.envs.context import EnvContext
from headrace.envs.message import MessageEnv, MessageStep
from headrace.plugins.registry import register_env
from headrace.renderers import Message, Renderer
from headrace.tasks.grading import grade_async
from headrace.tasks.problem_sets import ListDataset
from headrace.tasks.sandbox import Limits, run_tool
from headrace.tasks.word_math import split_of

CALL = re.compile(r"<calc>(.*?)(?:</calc>|$)", re.DOTALL)  # an unclosed call at the end still counts
LIMITS = Limits(cpu_s=1.0, memory_mb=256, wall_s=5.0, output_bytes=2048, site_packages=False)
PROMPT = (
    "What is {expression}? You have a calculator: write <calc>EXPRESSION</calc>, for example <calc>12*34</calc>, "
    "and its result comes back. When you know the result, reply with the final number only."
)


def make_problem(rng: random.Random, digits: int, terms: int) -> tuple[str, int]:
    """An expression of ``terms`` operands of up to ``digits`` digits, and its exact value."""
    numbers = [rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1) for _ in range(terms)]
    ops = [rng.choice("+-*") for _ in range(terms - 1)]
    expression = str(numbers[0]) + "".join(f"{op}{n}" for op, n in zip(ops, numbers[1:], strict=True))
    return expression, eval(expression, {"__builtins__": {}})  # digits and + - * only, made here


def problem_in(split: str, key: str, digits: int, terms: int) -> tuple[str, int]:
    """The first expression drawn from a generator seeded by ``key`` that falls in ``split``."""
    for attempt in itertools.count():
        rng = random.Random(f"tool_calc/{digits}/{terms}/{key}/{attempt}")
        expression, value = make_problem(rng, digits, terms)
        if split_of(expression) == split:
            return expression, value
    raise AssertionError("unreachable")


def example(tool_role: str) -> list[Message]:
    """One worked exchange, shown before the question with ``few_shot``."""
    return [
        {"role": "user", "content": PROMPT.format(expression="12*34+5")},
        {"role": "assistant", "content": "<calc>12*34+5</calc>"},
        {"role": tool_role, "content": "413"},
        {"role": "assistant", "content": "413"},
    ]


class ToolCalcEnv(MessageEnv):
    def __init__(
        self,
        expression: str,
        answer: int,
        renderer: Renderer,
        max_tokens: int,
        max_turns: int = 4,
        tool_role: str = "tool",
        few_shot: bool = False,
        limits: Limits = LIMITS,
    ):
        super().__init__(renderer, max_tokens, max_turns=max_turns)
        self.expression, self.answer, self.tool_role, self.limits = expression, answer, tool_role, limits
        self.few_shot = few_shot
        self.tool_calls = self.tool_errors = 0

    def initial_messages(self) -> Sequence[Message]:
        self.tool_calls = self.tool_errors = 0
        shown = example(self.tool_role) if self.few_shot else []
        return [*shown, {"role": "user", "content": PROMPT.format(expression=self.expression)}]

    async def respond(self, text: str, clean: bool) -> MessageStep:
        call = CALL.search(text)
        if call is None or self.last_turn:
            graded = await grade_async(CALL.sub("", text), str(self.answer))  # a call's numbers are no answer
            metrics = {"correct": float(graded.correct), "tool_calls": self.tool_calls, "tool_errors": self.tool_errors}
            return MessageStep(float(graded.correct), done=True, metrics=metrics)
        self.tool_calls += 1
        result = await run_tool(call.group(1), self.limits, tool="calculator")
        if result.ok:
            reply = result.stdout.strip()
        else:
            self.tool_errors += 1
            lines = result.stderr.strip().splitlines()
            reply = f"error: {result.killed_reason}" if result.killed_reason else (lines[-1] if lines else "error")
        return MessageStep(messages=[{"role": self.tool_role, "content": reply}])


OPTIONS = {
    "digits": 3,
    "terms": 3,
    "max_turns": 4,
    "tool_role": "tool",
    "few_shot": False,
    "split": "train",
    "eval_size": 200,
}


@register_env("tool_calc", options=OPTIONS)
def make_dataset(ctx: EnvContext) -> RLDataset:
    """Multi-turn tool use: a sandboxed <calc> calculator, reward on the final answer."""
    options = ctx.options
    if options["digits"] < 1 or options["terms"] < 2 or options["max_turns"] < 1:
        raise ValueError(f"the tool_calc env needs digits >= 1, terms >= 2 and max_turns >= 1 (got {options})")
    renderer = ctx.renderer
    digits, terms = options["digits"], options["terms"]

    def group(expression_and_value: tuple[str, int]) -> GroupOf:
        expression, value = expression_and_value
        kwargs = {
            "expression": expression,
            "answer": value,
            "renderer": renderer,
            "max_tokens": ctx.max_tokens,
            "max_turns": options["max_turns"],
            "tool_role": options["tool_role"],
            "few_shot": options["few_shot"],
        }
        return GroupOf(ToolCalcEnv, kwargs, ctx.group_size, tags=("tool_calc",))

    if options["split"] == "test":
        problems = [problem_in("test", f"test/{i}", digits, terms) for i in range(options["eval_size"])]
        return ListDataset(problems, group, ctx.batch_size)
    return ProblemDataset(
        lambda rng: group(problem_in("train", str(rng.getrandbits(48)), digits, terms)),
        ctx.batch_size,
        max(ctx.steps, 1),
        ctx.seed,
    )

"""``arithmetic``: single turn, on :class:`~headrace.envs.message.ProblemEnv`. A sum to answer,
reward 1 when the answer is the result.

On the embedded tiny model (renderer ``tiny``) the prompt is the bare completion ``a+b=``, which
the model learns from scratch, and the whole answer is graded: the sum, then the stop token
(spaces around the sum allowed), so ``8k8e`` is wrong for ``4+4=``, and so is ``8`` cut off at
``max_tokens`` (the tiny tokenizer's pad, bos and unk print nothing, so "8" and three of them
would otherwise count: a run learnt exactly that at ``max_tokens`` 2). On a
chat model it is the question "What is a+b? Answer with the number only." in the model's own
format, and the answer is the last number of the reply, so "The answer is 5." and "2 + 3 = 5"
are both right (SmolLM2-135M-Instruct writes the second, mostly); ``exact`` in the metrics says
whether nothing but the number was written.
``completion_or_chat`` picks the form; the renderer makes the tokens.

Options (``env_options``): ``max_operand`` (default 4, so sums are one digit), ``ops`` (default
``"+"``; any of ``+-*``), ``balanced`` (default true: draw a result evenly, then one of the
problems that give it, so ``0+0=`` and ``4+4=`` come up as often as the sums of four; drawn
operand by operand, 4 is the answer to 5 of the 25 problems and a model learning from scratch
collapses onto it: benchmarks/RESULTS.md, "The default run"), ``split`` (taken for the eval's
``split=test``, but there is no held-out split: eval problems differ from the training ones by
their seed only).
"""

from __future__ import annotations

import random
import re

from headrace.envs.base import GroupOf, ProblemDataset
from headrace.envs.context import EnvContext
from headrace.envs.message import MessageStep, PlainText, ProblemEnv, Verdict, completion_or_chat
from headrace.plugins.registry import register_env
from headrace.renderers import Renderer

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")  # 1,000 and 5.0 as a chat model may write them
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticEnv(ProblemEnv):
    def __init__(self, question: str, answer: str, renderer: Renderer, max_tokens: int):
        super().__init__(renderer, max_tokens)
        self.text, self.answer = question, answer
        self.bare = renderer.name == PlainText.name
        self.clean = False  # whether the answer ended at the stop token (set by respond)

    def question(self) -> str:
        return self.text

    async def respond(self, text: str, clean: bool) -> MessageStep:
        self.clean = clean
        return await super().respond(text, clean)

    async def check_answer(self, text: str) -> Verdict:
        text = text.strip()
        if self.bare:
            # the whole answer: the sum, then its end token (spaces around it allowed); an answer cut
            # off at max_tokens is wrong, or "8" and three tokens that print nothing would count
            correct = self.clean and text == self.answer
        else:
            numbers = _NUMBER.findall(text)
            correct = bool(numbers) and re.sub(r"\.0+$", "", numbers[-1].replace(",", "")) == self.answer
        return Verdict(float(correct), {"exact": float(text == self.answer)})


def question(a: int, op: str, b: int, bare: bool) -> str:
    return f"{a}{op}{b}=" if bare else f"What is {a}{op}{b}? Answer with the number only."


# balanced=true lists every problem once; past this many, draw the operands instead
MAX_LISTED_PROBLEMS = 200_000


@register_env("arithmetic", options={"max_operand": 4, "ops": "+", "balanced": True, "split": "train"})
def make_dataset(ctx: EnvContext) -> ProblemDataset:
    """Single turn: answer a+b=, reward 1 when right (options max_operand, ops, balanced)."""
    max_operand, ops = ctx.options["max_operand"], ctx.options["ops"]
    unknown = set(ops) - set(_OPS)
    if max_operand < 1 or unknown:
        raise ValueError(f"arithmetic env: need max_operand >= 1 and ops from '+-*' (got {max_operand}, {ops!r})")
    renderer = completion_or_chat(ctx)
    bare = renderer.name == PlainText.name
    longest = max(len(str(_OPS[op](a, b))) for op in ops for a in (0, max_operand) for b in (0, max_operand))
    if bare and ctx.max_tokens < longest + 1:  # graded with its stop token: it could never be right
        raise ValueError(
            f"arithmetic env: max_operand={max_operand} with ops {ops!r} has answers of {longest} characters, "
            f"and with the end token that is {longest + 1} tokens, more than sampling.max_tokens={ctx.max_tokens} "
            f"(the tiny model's default is 2): pass --max-tokens {longest + 1}"
        )

    by_result: dict[int, list[tuple[int, str, int]]] = {}
    if ctx.options["balanced"]:
        if (max_operand + 1) ** 2 * len(ops) > MAX_LISTED_PROBLEMS:
            raise ValueError(
                f"arithmetic env: balanced=true lists every problem to draw their results evenly, and "
                f"max_operand={max_operand} with ops {ops!r} makes more than {MAX_LISTED_PROBLEMS:,}; "
                "set env_options.balanced=false to draw the operands evenly instead"
            )
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                for op in ops:
                    by_result.setdefault(_OPS[op](a, b), []).append((a, op, b))
    results = sorted(by_result)

    def make_group(rng: random.Random) -> GroupOf:
        if results:  # a result first, then one of the problems that have it
            a, op, b = rng.choice(by_result[rng.choice(results)])
        else:
            a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        kwargs = dict(
            question=question(a, op, b, bare), answer=str(_OPS[op](a, b)), renderer=renderer, max_tokens=ctx.max_tokens
        )
        return GroupOf(ArithmeticEnv, kwargs, ctx.group_size, tags=("arithmetic",))

    return ProblemDataset.from_context(ctx, make_group)

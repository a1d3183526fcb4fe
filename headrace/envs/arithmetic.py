"""``arithmetic``: single turn. The prompt is ``a+b=``; the reward is 1 when the first integer
in the answer is the result (``exact`` in the metrics says whether nothing else was written).

Options (``env_options``): ``max_operand`` (default 4, so sums are one digit and an untrained
model scores ~6% by chance: enough signal for RL from scratch), ``ops`` (default ``"+"``; any
of ``+-*``).
"""

from __future__ import annotations

import random
import re

from headrace.core.types import Env, EnvContext, SampledTokens, StepResult, StopCondition, Tokenizer, Tokens
from headrace.envs.base import GroupOf, ProblemDataset
from headrace.run.registry import register_env

_FIRST_INT = re.compile(r"-?\d+")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticEnv(Env):
    def __init__(self, question: str, answer: str, tokenizer: Tokenizer, max_tokens: int):
        self.question, self.answer = question, answer
        self.tokenizer, self.max_tokens = tokenizer, max_tokens

    async def initial_observation(self) -> tuple[Tokens, StopCondition]:
        return self.tokenizer.encode(self.question), StopCondition(self.max_tokens, (self.tokenizer.eos_token_id,))

    async def step(self, action: SampledTokens) -> StepResult:
        text = self.tokenizer.decode(action.tokens).strip()
        number = _FIRST_INT.search(text)
        correct = float(number is not None and number.group() == self.answer)
        exact = float(text == self.answer)
        return StepResult(reward=correct, done=True, metrics={"correct": correct, "exact": exact})


@register_env("arithmetic")
def make_dataset(ctx: EnvContext) -> ProblemDataset:
    """Single turn: answer a+b=, reward 1 when right (options max_operand, ops)."""
    max_operand = int(ctx.options.get("max_operand", 4))
    ops = str(ctx.options.get("ops", "+"))
    unknown = set(ops) - set(_OPS)
    if max_operand < 1 or unknown:
        raise ValueError(f"arithmetic env: need max_operand >= 1 and ops from '+-*' (got {max_operand}, {ops!r})")

    def make_group(rng: random.Random) -> GroupOf:
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        kwargs = dict(
            question=f"{a}{op}{b}=", answer=str(_OPS[op](a, b)), tokenizer=ctx.tokenizer, max_tokens=ctx.max_tokens
        )
        return GroupOf(ArithmeticEnv, kwargs, ctx.group_size, tags=("arithmetic",))

    return ProblemDataset.from_context(ctx, make_group)

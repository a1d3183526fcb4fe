"""``arithmetic``: single turn. The prompt is ``a+b=``; the reward is 1 for the exact sum.

Options (``env_options``): ``max_operand`` (default 9, so sums have one or two digits),
``ops`` (default ``"+"``; any of ``+-*``).
"""

from __future__ import annotations

import random

from headrace.engine.registry import register_env
from headrace.engine.types import EnvContext, SampledTokens, StepResult, StopCondition, Tokenizer, Tokens
from headrace.envs.base import GroupOf, ProblemDataset
from headrace.engine.types import Env

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticEnv(Env):
    def __init__(self, question: str, answer: str, tokenizer: Tokenizer, max_tokens: int):
        self.question, self.answer = question, answer
        self.tokenizer, self.max_tokens = tokenizer, max_tokens

    async def initial_observation(self) -> tuple[Tokens, StopCondition]:
        return self.tokenizer.encode(self.question), StopCondition(self.max_tokens, (self.tokenizer.eos_token_id,))

    async def step(self, action: SampledTokens) -> StepResult:
        text = self.tokenizer.decode(action.tokens).strip()
        correct = float(text == self.answer)
        return StepResult(reward=correct, done=True, metrics={"correct": correct, "format": float(text.lstrip("-").isdigit())})


@register_env("arithmetic")
def make_dataset(ctx: EnvContext) -> ProblemDataset:
    max_operand = int(ctx.options.get("max_operand", 9))
    ops = str(ctx.options.get("ops", "+"))
    unknown = set(ops) - set(_OPS)
    if max_operand < 1 or unknown:
        raise ValueError(f"arithmetic env: need max_operand >= 1 and ops from '+-*' (got {max_operand}, {ops!r})")

    def make_group(rng: random.Random) -> GroupOf:
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        kwargs = dict(question=f"{a}{op}{b}=", answer=str(_OPS[op](a, b)), tokenizer=ctx.tokenizer, max_tokens=ctx.max_tokens)
        return GroupOf(ArithmeticEnv, kwargs, ctx.group_size, tags=("arithmetic",))

    return ProblemDataset(make_group, ctx.batch_size, max(ctx.steps, 1), ctx.seed)

"""``guess_number``: multi-turn. Guess a secret number; after each wrong guess the env answers
``higher`` or ``lower`` and the conversation goes on, up to ``max_guesses``. Reward 1 for a
correct guess, less a small cost per extra turn.

Each next observation extends the previous observation + action, so the whole episode trains
as one datum with the feedback tokens masked out.
Options: ``max_number`` (default 9), ``max_guesses`` (default 4).
"""

from __future__ import annotations

import random

from headrace.core.types import Env, EnvContext, SampledTokens, StepResult, StopCondition, Tokenizer, Tokens
from headrace.envs.base import GroupOf, ProblemDataset
from headrace.run.registry import register_env


class GuessNumberEnv(Env):
    def __init__(self, secret: int, max_number: int, max_guesses: int, tokenizer: Tokenizer, max_tokens: int):
        self.secret, self.max_number, self.max_guesses = secret, max_number, max_guesses
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self.history: Tokens = []
        self.guesses = 0

    def _stop(self) -> StopCondition:
        return StopCondition(self.max_tokens, (self.tokenizer.eos_token_id,))

    async def initial_observation(self) -> tuple[Tokens, StopCondition]:
        self.history = self.tokenizer.encode(f"guess 0-{self.max_number}:")
        return list(self.history), self._stop()

    async def step(self, action: SampledTokens) -> StepResult:
        self.guesses += 1
        text = self.tokenizer.decode(action.tokens).strip()
        guess = int(text) if text.isdigit() else None
        if guess == self.secret:
            return StepResult(
                reward=1.0 - 0.1 * (self.guesses - 1), done=True, metrics={"solved": 1.0, "guesses": self.guesses}
            )
        if self.guesses >= self.max_guesses:
            return StepResult(reward=0.0, done=True, metrics={"solved": 0.0, "guesses": self.guesses})
        hint = "?" if guess is None else ("higher" if guess < self.secret else "lower")
        self.history = self.history + list(action.tokens) + self.tokenizer.encode(f" {hint}:")
        return StepResult(reward=0.0, done=False, next_observation=list(self.history), next_stop=self._stop())


@register_env("guess_number")
def make_dataset(ctx: EnvContext) -> ProblemDataset:
    """Multi-turn: find a secret number from higher/lower replies."""
    max_number = int(ctx.options.get("max_number", 9))
    max_guesses = int(ctx.options.get("max_guesses", 4))
    if max_number < 1 or max_guesses < 1:
        raise ValueError(
            f"guess_number env: need max_number >= 1 and max_guesses >= 1 (got {max_number}, {max_guesses})"
        )

    def make_group(rng: random.Random) -> GroupOf:
        kwargs = dict(
            secret=rng.randint(0, max_number),
            max_number=max_number,
            max_guesses=max_guesses,
            tokenizer=ctx.tokenizer,
            max_tokens=ctx.max_tokens,
        )
        return GroupOf(GuessNumberEnv, kwargs, ctx.group_size, tags=("guess_number",))

    return ProblemDataset.from_context(ctx, make_group)

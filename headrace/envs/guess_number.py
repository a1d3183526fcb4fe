"""``guess_number``: multi-turn, on :class:`~headrace.envs.message.MessageEnv`. Guess a secret
number; after each wrong guess the env answers higher or lower and the conversation goes on, up
to ``max_guesses``. Reward 1 for a correct guess, less 0.1 per extra turn.

On the embedded tiny model (renderer ``tiny``) the conversation is bare text, ``guess 0-9:``
then `` higher:`` or `` lower:`` (`` ?:`` when the reply is not a number alone); on a chat model
it is chat turns ("Higher.") in the model's own format, and the first number in a reply is the
guess. Either way each next observation extends the previous observation + action exactly, so
the whole episode trains as one datum with the env's turns masked out.

Options: ``max_number`` (default 9), ``max_guesses`` (default 4).
"""

from __future__ import annotations

import random
import re
from typing import Any

from headrace.envs.base import GroupOf, ProblemDataset
from headrace.envs.context import EnvContext
from headrace.envs.message import MessageEnv, MessageStep, PlainText, completion_or_chat
from headrace.plugins.registry import register_env
from headrace.renderers import Message, Renderer

_FIRST_INT = re.compile(r"-?\d+")


class GuessNumberEnv(MessageEnv):
    def __init__(self, secret: int, max_number: int, max_guesses: int, renderer: Renderer, max_tokens: int):
        super().__init__(renderer, max_tokens, max_turns=max_guesses)
        self.secret, self.max_number = secret, max_number
        self.bare = renderer.name == PlainText.name

    def initial_messages(self) -> list[Message]:
        if self.bare:
            return [{"role": "user", "content": f"guess 0-{self.max_number}:"}]
        opening = f"I am thinking of a whole number from 0 to {self.max_number}. Guess it: reply with the number only."
        return [{"role": "user", "content": opening}]

    def guess(self, text: str) -> int | None:
        if self.bare:  # the number alone: the tiny model's reply is nothing else
            text = text.strip()
            return int(text) if text.isdigit() else None
        number = _FIRST_INT.search(text)
        return None if number is None else int(number.group())

    async def respond(self, text: str, clean: bool) -> MessageStep:
        guess = self.guess(text)
        if guess == self.secret:
            return MessageStep(1.0 - 0.1 * (self.turns - 1), done=True, metrics={"solved": 1.0, "guesses": self.turns})
        if self.last_turn:
            return MessageStep(0.0, done=True, metrics={"solved": 0.0, "guesses": self.turns})
        return MessageStep(messages=[self.hint(guess)])

    def hint(self, guess: int | None) -> str:
        if self.bare:
            return f" {'?' if guess is None else 'higher' if guess < self.secret else 'lower'}:"
        if guess is None:
            return f"Reply with a number from 0 to {self.max_number}."
        return "Higher." if guess < self.secret else "Lower."


# split: taken for the eval's split=test, but there is no held-out split (problems differ by seed)
OPTIONS = {"max_number": 9, "max_guesses": 4, "split": "train"}


@register_env("guess_number", options=OPTIONS)
def make_dataset(ctx: EnvContext) -> ProblemDataset:
    """Multi-turn: find a secret number from higher/lower replies."""
    return guess_dataset(ctx, GuessNumberEnv, "guess_number")


def guess_dataset(ctx: EnvContext, env_class: type[GuessNumberEnv], tag: str, **extra: Any) -> ProblemDataset:
    """guess_number's problems (options ``max_number``, ``max_guesses``), played by ``env_class``
    (a subclass, e.g. one whose replies cost tool time), which also gets ``extra``."""
    max_number, max_guesses = ctx.options["max_number"], ctx.options["max_guesses"]
    if max_number < 1 or max_guesses < 1:
        raise ValueError(f"{tag} env: need max_number >= 1 and max_guesses >= 1 (got {max_number}, {max_guesses})")
    renderer = completion_or_chat(ctx)

    def make_group(rng: random.Random) -> GroupOf:
        kwargs = dict(
            secret=rng.randint(0, max_number),
            max_number=max_number,
            max_guesses=max_guesses,
            renderer=renderer,
            max_tokens=ctx.max_tokens,
            **extra,
        )
        return GroupOf(env_class, kwargs, ctx.group_size, tags=(tag,))

    return ProblemDataset.from_context(ctx, make_group)

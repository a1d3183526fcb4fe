"""``slow_tools``: a multi-turn agent whose tool calls take time (a benchmark env).

``guess_number``'s conversation, where each reply that continues the episode is a tool call
costing ``tool_s`` seconds of env time (default 0.05) before the next turn is sampled: an agent
that waits on a sandbox, a search, a test run. The sampler is free while a tool runs, so a
scheduler that keeps it busy with other groups wins. Options: those of ``guess_number``, and
``tool_s``. The bench's ideal bound reads ``tool_s`` as the env time before each member's own
sample request (``headrace/bench/ideal.py``).
"""

from __future__ import annotations

import asyncio
import random

from headrace.core.types import EnvContext
from headrace.envs.base import GroupOf, ProblemDataset
from headrace.envs.guess_number import GuessNumberEnv
from headrace.envs.message import MessageStep, completion_or_chat


class SlowToolEnv(GuessNumberEnv):
    tool_s = 0.05

    async def respond(self, text: str, clean: bool) -> MessageStep:
        step = await super().respond(text, clean)
        if not step.done:
            await asyncio.sleep(self.tool_s)  # the tool call whose answer is the next observation
        return step


def make_dataset(ctx: EnvContext) -> ProblemDataset:
    """guess_number with a ``tool_s``-second tool call before every next turn."""
    max_number = int(ctx.options.get("max_number", 9))
    max_guesses = int(ctx.options.get("max_guesses", 4))
    tool_s = float(ctx.options.get("tool_s", SlowToolEnv.tool_s))
    if max_number < 1 or max_guesses < 1 or tool_s < 0:
        raise ValueError(
            f"slow_tools env: need max_number >= 1, max_guesses >= 1 and tool_s >= 0 "
            f"(got {max_number}, {max_guesses}, {tool_s})"
        )
    renderer = completion_or_chat(ctx)
    env_class = type("SlowToolEnv", (SlowToolEnv,), {"tool_s": tool_s})

    def make_group(rng: random.Random) -> GroupOf:
        kwargs = dict(
            secret=rng.randint(0, max_number),
            max_number=max_number,
            max_guesses=max_guesses,
            renderer=renderer,
            max_tokens=ctx.max_tokens,
        )
        return GroupOf(env_class, kwargs, ctx.group_size, tags=("slow_tools",))

    return ProblemDataset.from_context(ctx, make_group)

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
import dataclasses
from typing import Any

from headrace.envs.base import ProblemDataset
from headrace.envs.context import EnvContext
from headrace.envs.guess_number import OPTIONS, GuessNumberEnv, guess_dataset
from headrace.envs.message import MessageStep
from headrace.plugins.env_options import read_options


class SlowToolEnv(GuessNumberEnv):
    def __init__(self, *args: Any, tool_s: float = 0.05, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.tool_s = tool_s

    async def respond(self, text: str, clean: bool) -> MessageStep:
        step = await super().respond(text, clean)
        if not step.done:
            await asyncio.sleep(self.tool_s)  # the tool call whose answer is the next observation
        return step


def make_dataset(ctx: EnvContext) -> ProblemDataset:
    """guess_number with a ``tool_s``-second tool call before every next turn."""
    options = read_options("slow_tools", ctx.options, {**OPTIONS, "tool_s": 0.05})
    tool_s = options.pop("tool_s")
    if tool_s < 0:
        raise ValueError(f"slow_tools env: need tool_s >= 0 (got {tool_s})")
    return guess_dataset(dataclasses.replace(ctx, options=options), SlowToolEnv, "slow_tools", tool_s=tool_s)

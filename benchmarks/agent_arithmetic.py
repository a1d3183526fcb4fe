"""Chat arithmetic through the agents' endpoint: the ``arithmetic`` env's task, asked by an agent.

    headrace run --backend torch --model smollm2-135m --env benchmarks/agent_arithmetic.py:make_dataset \\
        --steps 20 --batch-size 8 --group-size 8 --max-tokens 16 --set torch.num_threads=1 \\
        --set eval.every=10 --set eval.problems=64 --set eval.env_options.split=test

The agent asks "What is a+b? Answer with the number only." (a, b in 0-9) with the real ``openai``
client and returns 1 when the last number of the reply is the sum: what the ``arithmetic`` env
asks a chat model, so the run compares with issue 12's (``benchmarks/RESULTS.md``, "Chat
arithmetic"). ``split``: ``train`` or ``test`` (held-out sums, by a hash of their text).
"""

from __future__ import annotations

import random
import re

from headrace.agents import AgentEpisode, AgentResult, agent_env
from headrace.envs.context import EnvContext
from headrace.tasks.word_math import split_of

NUMBER = re.compile(r"-?\d+")


async def ask(episode: AgentEpisode) -> AgentResult:
    a, b = episode.problem
    reply = await episode.openai().chat.completions.create(
        model=episode.model, messages=[{"role": "user", "content": f"What is {a}+{b}? Answer with the number only."}]
    )
    numbers = NUMBER.findall(reply.choices[0].message.content or "")
    correct = float(bool(numbers) and int(numbers[-1]) == a + b)
    return AgentResult(correct, metrics={"correct": correct})


def make_dataset(ctx: EnvContext):
    split = str(ctx.options.get("split", "train"))

    def problem(rng: random.Random) -> tuple[int, int]:
        while True:
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            if split_of(f"{a}+{b}", held_out_fraction=0.25) == split:
                return a, b

    return agent_env(ctx, ask, problem, tags=("agent_arithmetic",))

"""A multi-turn env in messages: answer a sum, and when wrong, get one more try.

Shows :class:`headrace.envs.message.MessageEnv`: ``initial_messages()`` opens the conversation
and ``respond(text, clean)`` answers each assistant turn with a reward, whether it is over and
the next user message. The next prompt extends the previous prompt and the sampled tokens
exactly (token in / token out), so the whole episode trains as one sequence with the env's
turns masked out. Reward: 1 right at once, 0.5 right on the second try, 0 otherwise.

Run it::

    headrace run --env examples/multi_turn.py:make_dataset --steps 20

What it printed here (trimmed)::

    step 20/20  reward 0.085  167 traj/s  1.27k tok/s  stale 0/0  done
    metric           first 2 steps   last 2 steps
    reward/mean             0.0454         0.0957
    time/step                 3.42           2.98
    20 steps in 62.5 s; 10,240 trajectories in 62.5 s of training: 164 traj/s, 1.26k tok/s; groups dropped: 0

``env/all/first_try`` in ``metrics.jsonl`` (right at the first answer) went 0.027 -> 0.061.
"""

from __future__ import annotations

import random

from headrace import EnvContext, GroupOf, ProblemDataset
from headrace.envs.message import MessageEnv, MessageStep
from headrace.renderers import Message, Renderer
from headrace.tasks.grading import grade


class SumWithRetry(MessageEnv):
    def __init__(self, a: int, b: int, renderer: Renderer, max_tokens: int):
        super().__init__(renderer, max_tokens, max_turns=2)
        self.a, self.b = a, b

    def initial_messages(self) -> list[Message]:
        return [{"role": "user", "content": f"what is {self.a}+{self.b}?"}]

    async def respond(self, text: str, clean: bool) -> MessageStep:
        right = grade(text, str(self.a + self.b)).correct
        if right or self.last_turn:  # the last turn allowed is always scored
            reward = (1.0 if self.turns == 1 else 0.5) if right else 0.0
            return MessageStep(reward, done=True, metrics={"first_try": float(right and self.turns == 1)})
        return MessageStep(messages=["no. try again:"])  # a bare string is a user message


def make_dataset(ctx: EnvContext) -> ProblemDataset:
    def group(rng: random.Random) -> GroupOf:
        a, b = rng.randint(0, 4), rng.randint(0, 4)
        return GroupOf.of(SumWithRetry, ctx.group_size, a=a, b=b, renderer=ctx.renderer, max_tokens=ctx.max_tokens)

    return ProblemDataset.from_context(ctx, group)

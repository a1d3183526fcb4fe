"""A single-turn env in messages: "what is a*b?", graded on the last number of the answer.

Shows :class:`headrace.envs.message.ProblemEnv`: the env gives a question (a string, or a list
of messages) and grades the answer text; the run's renderer (``ctx.renderer``: the tiny model's
format, or the chat template of ``--model smollm2-135m``) turns them into tokens, so no token
ids appear here. ``headrace.tasks.grading.grade`` reads the answer (``\\boxed{}``, ``#### N``
or the last number) and compares it exactly.

Run it (the default tiny model, from scratch on this CPU)::

    headrace run --env examples/single_turn.py:make_dataset --steps 40

What it printed here (trimmed)::

    step 1/40  reward 0.0254  960 traj/s  3.78k tok/s  stale 0/0  ETA 21s
    step 21/40  reward 0.629  940 traj/s  3.75k tok/s  stale 0/0  ETA 12s
    step 40/40  reward 0.34  1.77k traj/s  7.07k tok/s  stale 0/0  done
    metric           first 4 steps   last 4 steps
    reward/mean              0.141          0.415
    time/step                 0.74           0.28
    40 steps in 19.9 s; 20,480 trajectories in 19.8 s of training: 1.03k traj/s, 4.11k tok/s; groups dropped: 0
"""

from __future__ import annotations

import random

from headrace import EnvContext, GroupOf, ProblemDataset
from headrace.envs.message import ProblemEnv
from headrace.renderers import Renderer
from headrace.tasks.grading import grade


class Multiply(ProblemEnv):
    def __init__(self, a: int, b: int, renderer: Renderer, max_tokens: int):
        super().__init__(renderer, max_tokens)
        self.a, self.b = a, b

    def question(self) -> str:
        return f"what is {self.a}*{self.b}?"  # lower case: the tiny model's alphabet has no capitals

    async def check_answer(self, text: str) -> bool:
        return grade(text, str(self.a * self.b)).correct


def make_dataset(ctx: EnvContext) -> ProblemDataset:
    def group(rng: random.Random) -> GroupOf:
        a, b = rng.randint(0, 3), rng.randint(0, 3)  # small products: the tiny model learns them in minutes
        return GroupOf.of(Multiply, ctx.group_size, a=a, b=b, renderer=ctx.renderer, max_tokens=ctx.max_tokens)

    return ProblemDataset.from_context(ctx, group)

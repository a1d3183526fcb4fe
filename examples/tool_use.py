"""Tool use in messages: the model may call a calculator, ``<calc>EXPRESSION</calc>``, before it answers.

Shows a :class:`headrace.envs.message.MessageEnv` that runs a tool between turns. A reply with a
call gets the result back as the next message; a reply without one is the final answer, graded
on its last number. The tool runs in ``headrace.tasks.sandbox.run_tool``: a subprocess with CPU,
memory and wall-clock limits and no network, so whatever the model writes cannot reach out or
hang the run. (The built-in ``tool_calc`` env is the full version: ``--env tool_calc``.)

The result comes back as a user message ``result: N``: every renderer knows the user role,
while not every chat template has a tool role.

Run it (``--set env_options.digits=2`` for products a calculator is worth calling for, on a
pretrained model: ``--model smollm2-135m``)::

    headrace run --env examples/tool_use.py:make_dataset --steps 20 --max-tokens 16

What it printed here (trimmed)::

    step 20/20  reward 0.0137  128 traj/s  882 tok/s  stale 0/0  done
    metric           first 2 steps   last 2 steps
    reward/mean            0.00391         0.0146
    time/step                 3.81            3.3
    20 steps in 86.8 s; 10,240 trajectories in 86.7 s of training: 118 traj/s, 808 tok/s; groups dropped: 0

The tiny model, trained from scratch, never wrote a call in those 20 steps (``env/all/calls``
stays 0 in ``metrics.jsonl``): it only guesses the product. The env's tool path is exercised by
``tests/test_examples.py``. A pretrained model that can follow the worked exchange is what the
calculator is for (``--model smollm2-135m``; not measured with this file).
"""

from __future__ import annotations

import random
import re

from headrace import EnvContext, GroupOf, ProblemDataset
from headrace.envs.message import MessageEnv, MessageStep
from headrace.renderers import Message, Renderer
from headrace.tasks.grading import grade
from headrace.tasks.sandbox import Limits, run_tool

CALL = re.compile(r"<calc>(.*?)(?:</calc>|$)")
LIMITS = Limits(cpu_s=1.0, memory_mb=256, wall_s=5.0, output_bytes=256, site_packages=False)
PROMPT = "what is {}? you may write <calc>expression</calc> to use a calculator, then reply with the number."


class CalcEnv(MessageEnv):
    def __init__(self, expression: str, answer: int, renderer: Renderer, max_tokens: int):
        super().__init__(renderer, max_tokens, max_turns=3)
        self.expression, self.answer = expression, answer
        self.calls = 0

    def initial_messages(self) -> list[Message]:
        self.calls = 0
        # one worked exchange first: a small model calls no tool without seeing how
        return [
            {"role": "user", "content": PROMPT.format("12*34")},
            {"role": "assistant", "content": "<calc>12*34</calc>"},
            {"role": "user", "content": "result: 408"},
            {"role": "assistant", "content": "408"},
            {"role": "user", "content": PROMPT.format(self.expression)},
        ]

    async def respond(self, text: str, clean: bool) -> MessageStep:
        call = CALL.search(text)
        if call is None or self.last_turn:
            right = grade(CALL.sub("", text), str(self.answer)).correct  # a call's numbers are no answer
            return MessageStep(float(right), done=True, metrics={"correct": float(right), "calls": self.calls})
        self.calls += 1
        result = await run_tool(call.group(1), LIMITS, tool="calculator")
        reply = result.stdout.strip() if result.ok else "error"
        return MessageStep(messages=[f"result: {reply}"])


def make_dataset(ctx: EnvContext) -> ProblemDataset:
    digits = int(ctx.options.get("digits", 1))  # one digit: the untrained tiny model is sometimes right

    def group(rng: random.Random) -> GroupOf:
        a, b = (rng.randint(10 ** (digits - 1), 10**digits - 1) for _ in range(2))
        kwargs = {"expression": f"{a}*{b}", "answer": a * b, "renderer": ctx.renderer, "max_tokens": ctx.max_tokens}
        return GroupOf.of(CalcEnv, ctx.group_size, **kwargs)

    return ProblemDataset.from_context(ctx, group)

"""A ReAct agent with two tools, written with the plain ``openai`` client, trained as an env.

The agent is an ordinary async function. It gets its problem and an OpenAI-compatible endpoint of
its own (``episode.base_url``, ``episode.api_key``) and loops as any tool-using agent does: ask
the model, offering ``multiply`` and ``add`` as ``tools``; run each tool call the reply makes and
send the results back as ``tool`` messages; stop when a reply makes no call (its text is the
answer) or after ``max_calls`` calls. headrace serves that endpoint on loopback for the run,
answers each call with the run's sampler (the tools written in the model's format: Hermes
``<tool_call>`` blocks for a chat model, ``<call>name(a=1,b=2)</call>`` for the tiny one), and
trains on every call's tokens with the reward the agent returns: 1 for the right number, plus
``tool_bonus`` (0.2) when the episode made a valid tool call.

Options: ``digits`` (2: the operands' size), ``max_calls`` (4), ``tool_bonus`` (0.2),
``few_shot`` (true: one solved problem, with its calls, shown first), ``split`` (``train``;
``test``: the held-out problems, by a hash of their text). Metrics: ``correct``,
``used_tools`` (a valid call in the episode), and the endpoint's ``agent/tool_calls``,
``agent/invalid_tool_calls``, ``agent/calls_per_episode``, ``agent/prefix_extension_rate``.

Run it (the sim backend answers random digits: the mechanics, no learning)::

    headrace run --env examples/openai_agent.py:make_dataset --backend sim --steps 2 \
        --set advantages.filter_constant=false

What it printed here (trimmed)::

    step 2/2  reward 0  27.2 traj/s  95.1 tok/s  stale 0/0  done
    2 steps in 37.7 s; 1,024 trajectories in 37.6 s of training: 27.2 traj/s, 95.1 tok/s; groups dropped: 0

and in ``metrics.jsonl``: ``env/all/agent/calls_per_episode`` 1.0 and ``env/all/agent/tool_calls``
0.0 (a reply of digits makes no call, so it is the answer). With ``--backend torch --model
smollm2-135m`` the model is shown the tools in the Hermes format and the worked exchange; in the
12 episodes sampled here (64 and 96 tokens) SmolLM2-135M made no call: it worked the sum out in
prose, once writing a ``<tool_response>`` block of its own.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

from headrace.agents import AgentEpisode, AgentResult, agent_env
from headrace.envs.context import EnvContext
from headrace.plugins.env_options import read_options
from headrace.tasks.word_math import split_of

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{verb} two integers and return the result.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    for name, verb in (("multiply", "Multiply"), ("add", "Add"))
]
SYSTEM = (
    "You solve arithmetic with tools. Think about the next step, then call a tool. When you know the result, "
    "reply with the final number only."
)
NUMBER = re.compile(r"-?\d+")


def worked_example() -> list[dict[str, Any]]:
    """One solved problem shown before the question (``few_shot``): a small model calls no tool
    without seeing how."""

    def call(i: int, name: str, a: int, b: int) -> dict[str, Any]:
        arguments = json.dumps({"a": a, "b": b})
        return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}

    return [
        {"role": "user", "content": "What is 12 * 34 + 56?"},
        {"role": "assistant", "content": "First 12 * 34.", "tool_calls": [call(0, "multiply", 12, 34)]},
        {"role": "tool", "tool_call_id": "call_0", "content": "408"},
        {"role": "assistant", "content": "Then 408 + 56.", "tool_calls": [call(1, "add", 408, 56)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "464"},
        {"role": "assistant", "content": "464"},
    ]


def run_tool(name: str, arguments: str) -> str:
    """What a call returns: the result, or an error the model can read."""
    try:
        args = json.loads(arguments or "{}")
        a, b = int(args["a"]), int(args["b"])
    except (ValueError, KeyError, TypeError):
        return "error: give integers a and b"
    return str(a * b if name == "multiply" else a + b)


@dataclass(frozen=True)
class ReAct:
    max_calls: int = 4
    tool_bonus: float = 0.2
    few_shot: bool = True

    async def __call__(self, episode: AgentEpisode) -> AgentResult:
        a, b, c = episode.problem
        client = episode.openai()  # an AsyncOpenAI on this episode's endpoint
        shown = worked_example() if self.few_shot else []
        messages: list[Any] = [
            {"role": "system", "content": SYSTEM},
            *shown,
            {"role": "user", "content": f"What is {a} * {b} + {c}?"},
        ]
        calls = 0
        answer = None
        for _ in range(self.max_calls):
            response = await client.chat.completions.create(model=episode.model, messages=messages, tools=TOOLS)
            reply = response.choices[0].message
            messages.append(reply)
            if not reply.tool_calls:  # no call: the reply is the answer
                answer = reply.content
                break
            for call in reply.tool_calls:
                calls += 1
                result = run_tool(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        numbers = NUMBER.findall(answer or "")
        correct = float(bool(numbers) and int(numbers[-1]) == a * b + c)
        used = float(calls > 0)
        return AgentResult(correct + self.tool_bonus * used, metrics={"correct": correct, "used_tools": used})


def make_dataset(ctx: EnvContext):
    options = read_options(
        "openai_agent",
        ctx.options,
        {"digits": 2, "max_calls": 4, "tool_bonus": 0.2, "few_shot": True, "split": "train"},
    )
    low, high = 10 ** (options["digits"] - 1), 10 ** options["digits"] - 1

    def problem(rng: random.Random) -> tuple[int, int, int]:
        while True:
            a, b, c = (rng.randint(low, high) for _ in range(3))
            if split_of(f"{a}*{b}+{c}") == options["split"]:
                return a, b, c

    agent = ReAct(options["max_calls"], options["tool_bonus"], options["few_shot"])
    return agent_env(ctx, agent, problem, tags=("openai_agent",))

"""Agents written with the real ``openai`` client, as envs for the tests (``--env tests/agent_envs.py:NAME``).

``tools``: chat completions with two tools, the SDK's own message objects sent back, tool results;
``responses``: the Responses API, function calls and their outputs, ``previous_response_id``;
``rewrites``: an agent that rewrites its history (a summary replaces the exchange);
``flaky``: an agent that raises on some episodes (``env_options.fail_every``).
"""

from __future__ import annotations

import json
from typing import Any

from headrace.agents import AgentEpisode, AgentResult, agent_env
from headrace.envs.context import EnvContext

TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "add two numbers",
     "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}},
    {"type": "function", "function": {"name": "mul", "description": "multiply two numbers",
     "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}},
]  # fmt: skip
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
PROBLEMS = [(2, 3), (4, 5), (6, 7), (1, 8)]


def run_tool(name: str, arguments: str) -> str:
    args = json.loads(arguments or "{}")
    a, b = float(args.get("a", 0)), float(args.get("b", 0))
    return str(a + b if name == "add" else a * b)


def right(text: str | None, problem: tuple[int, int]) -> float:
    return float((text or "").strip() == str(problem[0] + problem[1]))


async def tool_agent(episode: AgentEpisode) -> AgentResult:
    """Up to three calls: each reply's tool calls are run and answered; a reply without any is
    asked once more to use a tool, so every episode is multi-turn even when no call is made."""
    a, b = episode.problem
    client = episode.openai()
    messages: list[Any] = [{"role": "user", "content": f"what is {a}+{b}? use the tools."}]
    text = None
    for _ in range(3):
        response = await client.chat.completions.create(model=episode.model, messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message)  # the SDK's own object, sent back as the SDK serialises it
        text = message.content
        if message.tool_calls:
            for call in message.tool_calls:
                result = run_tool(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        else:
            messages.append({"role": "user", "content": "use a tool, then answer."})
    return AgentResult(right(text, episode.problem), metrics={"agent_turns": 3.0})


async def responses_agent(episode: AgentEpisode) -> float:
    """The Responses API: a first response, then each next one from ``previous_response_id``
    with the outputs of its function calls (or a nudge)."""
    a, b = episode.problem
    client = episode.openai()
    response = await client.responses.create(
        model=episode.model, instructions="you add numbers.", input=f"what is {a}+{b}?", tools=RESPONSE_TOOLS
    )
    for _ in range(2):
        calls = [item for item in response.output if item.type == "function_call"]
        items: list[Any] = [
            {"type": "function_call_output", "call_id": c.call_id, "output": run_tool(c.name, c.arguments)}
            for c in calls
        ] or [{"role": "user", "content": "answer with the number."}]
        response = await client.responses.create(
            model=episode.model, instructions="you add numbers.", previous_response_id=response.id, input=items,
            tools=RESPONSE_TOOLS,
        )  # fmt: skip
    return right(response.output_text, episode.problem)


async def rewriting_agent(episode: AgentEpisode) -> float:
    """Two calls that continue the conversation, then one from a rewritten history (the exchange
    replaced by a summary): a new training sequence of the same episode."""
    a, b = episode.problem
    client = episode.openai()
    messages: list[Any] = [{"role": "user", "content": f"what is {a}+{b}?"}]
    for _ in range(2):
        reply = (await client.chat.completions.create(model=episode.model, messages=messages)).choices[0].message
        messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "sure?"}]
    summary = [{"role": "user", "content": f"earlier you said {reply.content}. what is {a}+{b}?"}]
    final = (await client.chat.completions.create(model=episode.model, messages=summary)).choices[0].message
    return right(final.content, episode.problem)


class AgentFailed(RuntimeError):
    pass


def flaky_agent(every: int):
    count = {"n": 0}

    async def agent(episode: AgentEpisode) -> float:
        client = episode.openai()
        await client.chat.completions.create(model=episode.model, messages=[{"role": "user", "content": "hi"}])
        count["n"] += 1
        if count["n"] % every == 0:
            raise AgentFailed(f"episode {count['n']} gives up")
        return 1.0

    return agent


def tools(ctx: EnvContext):
    return agent_env(ctx, tool_agent, PROBLEMS, tags=("tools",))


def responses(ctx: EnvContext):
    return agent_env(ctx, responses_agent, PROBLEMS, tags=("responses",))


def rewrites(ctx: EnvContext):
    return agent_env(ctx, rewriting_agent, PROBLEMS, tags=("rewrites",))


def flaky(ctx: EnvContext):
    return agent_env(ctx, flaky_agent(int(ctx.options.get("fail_every", 3))), PROBLEMS, tags=("flaky",))

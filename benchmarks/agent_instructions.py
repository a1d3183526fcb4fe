"""Machine instructions per agent call, under valgrind's cachegrind: figures the machine's load does
not move (``agent_overhead.py``'s CPU seconds do, by 2x on this shared machine).

    python benchmarks/agent_instructions.py [--steps 3] [--calls 200]

Per turn of a run (``agent_overhead.py``'s task through ``train()`` on a zero-latency sim, 4 turns
an episode): the native ``MessageEnv`` and the agent with the real ``openai`` client in process.
Per call, apart (a 3-message conversation): the SDK over the in-process transport against a
handler that returns a canned answer (the client's side alone), the same on the agents' endpoint
(its difference: the endpoint's side), the endpoint's handler called directly, and the SDK's
request transform alone (``openai._utils._transform``, run by every ``create``). Each figure is
the difference of two runs of this file under valgrind (with and without the measured part), so
imports and start-up cancel out. A few minutes in all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PARTS = ("sdk_canned", "sdk_endpoint", "endpoint_handler", "sdk_transform")
MESSAGES = [{"role": "user", "content": "count:"}, {"role": "assistant", "content": "1"},
            {"role": "user", "content": "next:"}]  # fmt: skip


def run_inner(kind: str, count: int) -> None:
    """``kind`` is native or agent (``count`` steps after a warm-up step) or a part (``count`` calls)."""
    sys.path.insert(0, HERE)
    import agent_overhead

    async def main() -> None:
        if kind in ("native", "agent"):
            await agent_overhead.measure(kind, "zero", 1, 4)  # first-use costs: imports, caches, the pool
            if count:
                await agent_overhead.measure(kind, "zero", count, 4)
        else:
            await parts(kind, count)

    asyncio.run(main())


async def parts(kind: str, count: int) -> None:
    import openai
    from openai._utils._transform import async_maybe_transform
    from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming

    from headrace.agents.endpoint import LIMITS, AgentEndpoint, shared_http_client
    from headrace.agents.env import AgentEnv, AgentEpisode
    from headrace.core.episode import EpisodeSpec, run_episode
    from headrace.core.types import SampledTokens, SamplingParams, StopReason
    from headrace.net.http import Request, Response
    from headrace.net.inprocess import InProcessTransport
    from headrace.renderers import renderer_for
    from headrace.tokenizers.char import CharTokenizer

    tok = CharTokenizer()

    async def instant(prompt: Any, n: int, params: Any) -> list[SampledTokens]:
        tokens = tok.encode("12") + [tok.eos_token_id]
        return [SampledTokens(tokens, [-1.0] * len(tokens), StopReason.STOP, 0)]

    canned: list[Response] = []

    async def answer(request: Request) -> Response:
        return canned[0]

    client_of_canned = openai.AsyncOpenAI(
        base_url="http://127.0.0.1/v1", api_key="k", max_retries=0,
        http_client=shared_http_client(InProcessTransport(answer, LIMITS, "a canned handler")),
    )  # fmt: skip
    endpoint = AgentEndpoint(renderer_for("tiny", tok), tok, 16, "tiny")
    params = {"model": "t", "messages": MESSAGES}

    async def agent(episode: AgentEpisode) -> float:
        headers = {"authorization": f"Bearer {episode.api_key}", "content-type": "application/json"}
        path = "/" + episode.base_url.split("/", 3)[3] + "/chat/completions"
        body = json.dumps(params).encode()
        canned.append(await endpoint(Request("POST", path, headers, body)))  # the endpoint's own answer
        client = episode.openai()
        calls = {
            "sdk_canned": lambda: client_of_canned.chat.completions.create(model="t", messages=MESSAGES),
            "sdk_endpoint": lambda: client.chat.completions.create(model="t", messages=MESSAGES),
            "endpoint_handler": lambda: endpoint(Request("POST", path, headers, body)),
            "sdk_transform": lambda: async_maybe_transform(params, CompletionCreateParamsNonStreaming),
        }
        for call in calls.values():  # every run warms every part: only the measured calls differ
            for _ in range(20):
                await call()
        for _ in range(count):
            await calls[kind]()
        return 1.0

    # a call's history piles up in its episode (the bridge looks back through it): the measured
    # calls repeat one conversation, which it finds nothing to extend in, at a cost that grows
    # with the calls; 200 calls add a few thousand instructions each, within this figure's noise
    spec = EpisodeSpec(SamplingParams(max_tokens=16), max_turns=10**6, seed=0, vocab_size=tok.vocab_size)
    async with endpoint.lifespan():
        await run_episode(AgentEnv(agent, None, endpoint), instant, spec, 0)


def instructions(kind: str, count: int) -> int:
    out = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
         sys.executable, __file__, "--inner", kind, str(count)],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "0"},
    ).stderr  # fmt: skip
    return int(re.search(r"I\s+refs:\s+([\d,]+)", out).group(1).replace(",", ""))  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--inner", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner is not None:
        run_inner(args.inner[0], int(args.inner[1]))
        return
    turns = args.steps * 8 * 4 * 4  # agent_overhead.py's runs: 8 groups of 4 a step, 4 turns an episode
    out: dict[str, float] = {}
    for kind in ("native", "agent"):
        out[f"{kind}_per_turn"] = (instructions(kind, args.steps) - instructions(kind, 0)) / turns
        print(f"{kind}: {out[f'{kind}_per_turn']:,.0f} instructions per turn", flush=True)
    base = instructions(PARTS[0], 0)
    for kind in PARTS:
        out[f"{kind}_per_call"] = (instructions(kind, args.calls) - base) / args.calls
        print(f"{kind}: {out[f'{kind}_per_call']:,.0f} instructions per call", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

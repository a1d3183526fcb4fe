"""What an agent episode through the endpoint costs per turn, against the same task as a native env.

    python benchmarks/agent_overhead.py [--steps 10] [--turns 4] [--latency multi_turn|remote_api|zero|all]

The task is a fixed conversation of ``--turns`` turns (the model answers, the env says "next",
the last answer is graded on being a number), written twice: as a ``MessageEnv``, and as an agent
that makes the same calls with the real ``openai`` client (``headrace.agents``). Both run through
``train()`` on the sim backend with the same config and render the same tokens (the tiny format).
``multi_turn`` takes the latencies of the ``multi_turn`` bench scenario (10 ms a request, 5 ms a
token; 8 groups of 4 in a batch), ``remote_api`` those of ``remote_api`` (60 ms a request, a 50 ms
training clock); ``zero`` a zero-latency sim, where every second is CPU: the difference of
the two CPU times per turn is the endpoint's cost per call. Ratios from one run on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from headrace.agents import AgentEpisode, agent_env
from headrace.envs.base import GroupOf, ProblemDataset
from headrace.envs.context import EnvContext
from headrace.envs.message import MessageEnv, MessageStep
from headrace.plugins import registry
from headrace.renderers import Message, Renderer
from headrace.run.config import RunConfig
from headrace.run.train import train

LATENCY = {
    "multi_turn": {"sample_request_s": 0.01, "sample_token_s": 0.005, "sample_jitter": 0.2, "sample_concurrency": 32,
                   "train_step_s": 0.01, "train_token_s": 0.00005, "optim_step_s": 0.01},
    "remote_api": {"sample_request_s": 0.06, "sample_token_s": 0.004, "sample_jitter": 0.2, "sample_concurrency": 64,
                   "clock_cycle_s": 0.05, "train_step_s": 0.03, "train_token_s": 0.0001, "optim_step_s": 0.02},
    "zero": {},
}  # fmt: skip


def graded(text: str) -> float:
    return float(text.strip().isdigit())


class CountEnv(MessageEnv):
    def __init__(self, renderer: Renderer, max_tokens: int, turns: int):
        super().__init__(renderer, max_tokens, max_turns=turns)

    def initial_messages(self) -> list[Message]:
        return [{"role": "user", "content": "count:"}]

    async def respond(self, text: str, clean: bool) -> MessageStep:
        if self.last_turn:
            return MessageStep(graded(text), done=True)
        return MessageStep(messages=["next:"])


def count_agent(turns: int):
    async def agent(episode: AgentEpisode) -> float:
        client = episode.openai()
        messages: list[Any] = [{"role": "user", "content": "count:"}]
        for turn in range(turns):
            reply = (await client.chat.completions.create(model=episode.model, messages=messages)).choices[0].message
            if turn + 1 < turns:
                messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "next:"}]
        return graded(reply.content or "")

    return agent


def config(env: str, latency: str, steps: int, turns: int, run_dir: str) -> RunConfig:
    return RunConfig(
        env=env, backend="sim", steps=steps, batch_size=8, group_size=4, max_turns=turns, scheduler="async",
        run_dir=run_dir, overwrite=True, sim=LATENCY[latency], advantages={"filter_constant": False},
    )  # fmt: skip


async def measure(kind: str, latency: str, steps: int, turns: int) -> dict[str, float]:
    def native(ctx: EnvContext) -> ProblemDataset:
        kwargs = {"renderer": ctx.renderer, "max_tokens": ctx.max_tokens, "turns": turns}
        return ProblemDataset.from_context(ctx, lambda rng: GroupOf(CountEnv, kwargs, ctx.group_size))

    def agents(ctx: EnvContext):
        return agent_env(ctx, count_agent(turns), [None])

    name = f"bench_{kind}"
    cfg = config(name, latency, steps, turns, f"/tmp/headrace-agent-overhead-{kind}")
    with registry.envs.temporarily(name, native if kind == "native" else agents):
        wall, cpu = time.perf_counter(), time.process_time()
        summary = await train(cfg)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    episodes = steps * cfg.batch_size * cfg.group_size
    calls = episodes * turns
    row = summary.metrics[-1]
    assert row.get("env/all/agent/calls_per_episode", turns) == turns, row
    return {"wall_s": wall, "cpu_s": cpu, "turns": calls, "wall_ms_per_turn": 1e3 * wall / calls,
            "cpu_ms_per_turn": 1e3 * cpu / calls}  # fmt: skip


async def breakdown(calls: int = 300) -> dict[str, float]:
    """CPU per call, split: the openai client against a server that only returns a canned
    completion, raw httpx against it (the HTTP round trip alone), and raw httpx against the
    agents' endpoint with a sampler that answers at once (the endpoint's own cost on top)."""
    import httpx
    import openai

    from headrace.agents.endpoint import AgentEndpoint
    from headrace.agents.env import AgentEnv
    from headrace.core.episode import EpisodeSpec, run_episode
    from headrace.core.types import SampledTokens, SamplingParams, StopReason
    from headrace.net.http import HttpServer, Response
    from headrace.renderers import renderer_for
    from headrace.tokenizers.char import CharTokenizer

    messages = [{"role": "user", "content": "count:"}, {"role": "assistant", "content": "1"},
                {"role": "user", "content": "next:"}]  # fmt: skip
    choice = {"index": 0, "message": {"role": "assistant", "content": "12"}, "finish_reason": "stop", "logprobs": None}
    usage = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    body = {"id": "c", "object": "chat.completion", "created": 0, "model": "t", "choices": [choice], "usage": usage}
    out: dict[str, float] = {}

    async def per_call(name: str, call) -> None:
        for _ in range(20):
            await call()
        cpu = time.process_time()
        for _ in range(calls):
            await call()
        out[name] = 1e3 * (time.process_time() - cpu) / calls

    async def canned(request):
        return Response.of_json(body)

    async with asyncio.TaskGroup() as tg:
        server = HttpServer(canned)
        await server.start(tg)
        url = f"http://127.0.0.1:{server.port}/v1"
        client = openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0)
        raw = httpx.AsyncClient()
        await per_call(
            "openai_client_canned_server_ms", lambda: client.chat.completions.create(model="t", messages=messages)
        )
        await per_call(
            "httpx_canned_server_ms", lambda: raw.post(f"{url}/chat/completions", json={"messages": messages})
        )
        await server.close()

    tok = CharTokenizer()

    async def instant(prompt, n, params):
        tokens = tok.encode("12") + [tok.eos_token_id]
        return [SampledTokens(tokens, [-1.0] * len(tokens), StopReason.STOP, 0)]

    async def agent(episode: AgentEpisode) -> float:
        headers = {"authorization": f"Bearer {episode.api_key}"}
        post, where = {"model": "t", "messages": messages}, f"{episode.base_url}/chat/completions"
        await per_call("httpx_agent_endpoint_ms", lambda: raw.post(where, json=post, headers=headers))
        return 1.0

    endpoint = AgentEndpoint(renderer_for("tiny", tok), tok, 16, "tiny")
    spec = EpisodeSpec(SamplingParams(max_tokens=16), max_turns=calls + 30, seed=0, vocab_size=tok.vocab_size)
    async with endpoint.lifespan():
        await run_episode(AgentEnv(agent, None, endpoint), instant, spec, 0)
    await raw.aclose()
    out["endpoint_own_ms"] = out["httpx_agent_endpoint_ms"] - out["httpx_canned_server_ms"]
    out["openai_client_own_ms"] = out["openai_client_canned_server_ms"] - out["httpx_canned_server_ms"]
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--latency", choices=[*LATENCY, "all"], default="all")
    args = parser.parse_args()
    import openai  # noqa: F401 - imported before the clocks start: a run pays it once, not per call

    await measure("agent", "zero", 1, args.turns)  # warm: first-use costs (imports, jinja, the pool)
    out: dict[str, Any] = {}
    for latency in [*LATENCY] if args.latency == "all" else [args.latency]:
        native = await measure("native", latency, args.steps, args.turns)
        agent = await measure("agent", latency, args.steps, args.turns)
        out[latency] = {
            "native": native,
            "agent": agent,
            "ratio_per_turn": agent["wall_ms_per_turn"] / native["wall_ms_per_turn"],
            "endpoint_cpu_ms_per_call": agent["cpu_ms_per_turn"] - native["cpu_ms_per_turn"],
        }
        print(f"{latency}: ratio {out[latency]['ratio_per_turn']:.2f}x per turn; native "
              f"{native['wall_ms_per_turn']:.2f} ms/turn, agent {agent['wall_ms_per_turn']:.2f} ms/turn; endpoint "
              f"CPU {out[latency]['endpoint_cpu_ms_per_call']:.2f} ms/call")  # fmt: skip
    out["breakdown"] = await breakdown()
    print("CPU per call: " + ", ".join(f"{k} {v:.2f}" for k, v in out["breakdown"].items()))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    asyncio.run(main())

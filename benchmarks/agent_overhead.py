"""What an agent episode through the endpoint costs per turn, against the same task as a native env.

    python benchmarks/agent_overhead.py [--steps 10] [--turns 4] [--latency zero|multi_turn|...|all]

The task is a fixed conversation of ``--turns`` turns (the model answers, the env says "next",
the last answer is graded on being a number), written twice: as a ``MessageEnv``, and as an agent
that makes the same calls with the real ``openai`` client (``headrace.agents``). Both run through
``train()`` on the sim backend with the same config and render the same tokens (the tiny format).
The agent runs twice: with ``episode.openai()`` (its calls handed to the endpoint in process) and
with ``episode.openai(loopback=True)`` (over the loopback socket, as a command's would go).
``LATENCY`` says what each setting models a call's sampling to cost; ``zero`` is a zero-latency
sim, where every second is CPU: the difference of the CPU times per turn is an agent's cost per
call. Ratios from one run on this machine (its load average is printed with them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from typing import Any

from headrace.agents import AgentEpisode, agent_env
from headrace.core.trace import CallCompleted, CallSubmitted
from headrace.envs.base import GroupOf, ProblemDataset
from headrace.envs.context import EnvContext
from headrace.envs.message import MessageEnv, MessageStep
from headrace.plugins import registry
from headrace.renderers import Message, Renderer
from headrace.run.config import RunConfig
from headrace.run.train import train

# What each setting models a call's sampling to cost: sample_request_s + tokens * sample_token_s
# (the sim's answers here are 3-4 tokens: a version stamp, one or two digits, the end token), at
# most sample_concurrency calls at once; a run has 8 groups of 4 episodes in flight.
LATENCY = {
    "zero": {},
    # the bench's multi_turn scenario: ~28 ms a call
    "multi_turn": {"sample_request_s": 0.01, "sample_token_s": 0.005, "sample_jitter": 0.2, "sample_concurrency": 32,
                   "train_step_s": 0.01, "train_token_s": 0.00005, "optim_step_s": 0.01},
    # the bench's remote_api scenario: ~74 ms a call, Tinker's 50 ms training clock
    "remote_api": {"sample_request_s": 0.06, "sample_token_s": 0.004, "sample_jitter": 0.2, "sample_concurrency": 64,
                   "clock_cycle_s": 0.05, "train_step_s": 0.03, "train_token_s": 0.0001, "optim_step_s": 0.02},
    # a hosted API or a loaded GPU server: 300 ms to the first token, then 50 tokens/s (~370 ms a call)
    "hosted_api": {"sample_request_s": 0.3, "sample_token_s": 0.02, "sample_jitter": 0.2, "sample_concurrency": 64,
                   "train_step_s": 0.03, "train_token_s": 0.0001, "optim_step_s": 0.02},
}  # fmt: skip
for _ms in (10, 20, 40, 80):  # the sweep: a call costs exactly this, 32 at once, training free
    LATENCY[f"call_{_ms}ms"] = {"sample_request_s": _ms / 1e3, "sample_concurrency": 32}
MEAN_ACTION_TOKENS = 3.5
FIGURES = ("httpx_agent_endpoint_ms", "openai_in_process_ms", "openai_loopback_ms", "openai_in_process_canned_ms",
           "openai_request_transform_ms", "openai_in_process_messages_in_extra_body_ms")  # fmt: skip


def call_ms(latency: str) -> float:
    """The sampling a call of this setting costs, modelled (jitter's mean left out)."""
    sim = LATENCY[latency]
    return 1e3 * (sim.get("sample_request_s", 0.0) + MEAN_ACTION_TOKENS * sim.get("sample_token_s", 0.0))


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


def count_agent(turns: int, loopback: bool = False):
    async def agent(episode: AgentEpisode) -> float:
        client = episode.openai(loopback=loopback)
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


class CallTimes:
    """A tracer: how many sample calls were in flight on average (their summed time over the run's),
    and the gap between a call's answer and the next call of its episode (the episode's own time
    between two turns: its CPU, and its wait for the loop). A native group's first call (member -1,
    n=G) counts as each member's."""

    def __init__(self) -> None:
        self.submitted: dict[int, float] = {}
        self.answered: dict[tuple[int, int, int], float] = {}  # (batch, group, member): its last call's answer
        self.busy = self.first = self.last = 0.0
        self.gaps: list[float] = []

    def __call__(self, event: Any) -> None:
        if not isinstance(event, CallSubmitted | CallCompleted) or event.op != "sample" or event.rollout is None:
            return
        batch, group, member = event.rollout
        if isinstance(event, CallSubmitted):
            self.submitted[event.call] = event.at
            self.first = self.first or event.at
            last = self.answered.get((batch, group, member))
            if last is None and member >= 0:
                last = self.answered.get((batch, group, -1))
            if last is not None:
                self.gaps.append(event.at - last)
        else:
            self.busy += event.at - self.submitted.pop(event.call)
            self.answered[(batch, group, member)] = self.last = event.at

    def figures(self) -> dict[str, float]:
        gaps = sorted(self.gaps) or [0.0]
        p90 = gaps[int(0.9 * (len(gaps) - 1))]
        return {"calls_in_flight": self.busy / max(self.last - self.first, 1e-9),
                "gap_ms_mean": 1e3 * sum(gaps) / len(gaps), "gap_ms_p90": 1e3 * p90}  # fmt: skip


async def measure(kind: str, latency: str, steps: int, turns: int) -> dict[str, float]:
    def native(ctx: EnvContext) -> ProblemDataset:
        kwargs = {"renderer": ctx.renderer, "max_tokens": ctx.max_tokens, "turns": turns}
        return ProblemDataset.from_context(ctx, lambda rng: GroupOf(CountEnv, kwargs, ctx.group_size))

    def agents(ctx: EnvContext):
        return agent_env(ctx, count_agent(turns, loopback=kind == "loopback"), [None])

    name = f"bench_{kind}"
    # a directory of its own: runs of this script at once would refuse each other's (a run's lock)
    run_dir = tempfile.TemporaryDirectory(prefix=f"headrace-agent-overhead-{kind}-")
    cfg = config(name, latency, steps, turns, run_dir.name)
    with run_dir, registry.envs.temporarily(name, native if kind == "native" else agents):
        wall, cpu = time.perf_counter(), time.process_time()
        times = CallTimes()
        summary = await train(cfg, tracer=times)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    episodes = steps * cfg.batch_size * cfg.group_size
    calls = episodes * turns
    row = summary.metrics[-1]
    assert row.get("env/all/agent/calls_per_episode", turns) == turns, row
    return {"wall_s": wall, "cpu_s": cpu, "turns": calls, "wall_ms_per_turn": 1e3 * wall / calls,
            "cpu_ms_per_turn": 1e3 * cpu / calls, **times.figures()}  # fmt: skip


async def breakdown(calls: int = 300) -> dict[str, float]:
    """CPU per call, split: the openai client against a server that only returns a canned
    completion, raw httpx against it (the HTTP round trip alone), raw httpx against the agents'
    endpoint with a sampler that answers at once (the endpoint's own cost on top), and the openai
    client on that endpoint in process (``episode.openai()``) and over loopback."""
    import httpx
    import openai
    from openai._utils._transform import async_maybe_transform
    from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming as CompletionCreateParams

    from headrace.agents.endpoint import LIMITS, AgentEndpoint, shared_http_client
    from headrace.agents.env import AgentEnv
    from headrace.core.episode import EpisodeSpec, run_episode
    from headrace.core.types import SampledTokens, SamplingParams, StopReason
    from headrace.net.http import HttpServer, Response
    from headrace.net.inprocess import InProcessTransport
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

    # the SDK over the in-process transport against a handler that returns the endpoint's answer
    # as it is: what a call costs without the endpoint
    answered: list[Response] = []

    async def canned_in_process(request: Any) -> Response:
        return answered[0]

    canned_client = openai.AsyncOpenAI(
        base_url="http://127.0.0.1/v1", api_key="k", max_retries=0,
        http_client=shared_http_client(InProcessTransport(canned_in_process, LIMITS, "a canned handler")),
    )  # fmt: skip
    params = {"model": "t", "messages": messages}

    def figures(episode: AgentEpisode) -> dict[str, Any]:
        """What each figure calls, each in an episode of its own (an episode's calls pile up)."""
        headers = {"authorization": f"Bearer {episode.api_key}"}
        where = f"{episode.base_url}/chat/completions"
        inside, wire = episode.openai(), episode.openai(loopback=True)
        return {
            "httpx_agent_endpoint_ms": lambda: raw.post(where, json=params, headers=headers),
            "openai_in_process_ms": lambda: inside.chat.completions.create(model="t", messages=messages),
            "openai_loopback_ms": lambda: wire.chat.completions.create(model="t", messages=messages),
            "openai_in_process_canned_ms": lambda: canned_client.chat.completions.create(model="t", messages=messages),
            # the SDK's request transform walks the messages against their TypedDicts on every
            # call; messages sent in extra_body skip it (the workaround of anthropic-sdk-python#1195)
            "openai_request_transform_ms": lambda: async_maybe_transform(params, CompletionCreateParams),
            "openai_in_process_messages_in_extra_body_ms": lambda: inside.chat.completions.create(
                model="t", messages=[], extra_body={"messages": messages}
            ),
        }

    def measuring(name: str):
        async def agent(episode: AgentEpisode) -> float:
            if not answered:
                reply = await episode.openai().chat.completions.with_raw_response.create(model="t", messages=messages)
                answered.append(Response(body=reply.content, headers=dict(reply.headers.items())))
            await per_call(name, figures(episode)[name])
            if name.startswith("openai_in_process_canned") or "transform" in name:
                await episode.openai().chat.completions.create(model="t", messages=messages)  # an episode samples
            return 1.0

        return agent

    endpoint = AgentEndpoint(renderer_for("tiny", tok), tok, 16, "tiny")
    spec = EpisodeSpec(SamplingParams(max_tokens=16), max_turns=calls + 30, seed=0, vocab_size=tok.vocab_size)
    async with endpoint.lifespan():  # as in a run: one server, the run's pools
        for name in FIGURES:
            await run_episode(AgentEnv(measuring(name), None, endpoint), instant, spec, 0)
    await raw.aclose()
    out["endpoint_own_ms"] = out["httpx_agent_endpoint_ms"] - out["httpx_canned_server_ms"]
    out["endpoint_own_in_process_ms"] = out["openai_in_process_ms"] - out["openai_in_process_canned_ms"]
    out["openai_client_own_ms"] = out["openai_client_canned_server_ms"] - out["httpx_canned_server_ms"]
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--latency", choices=[*LATENCY, "all"], default="all")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the CPU per call of the parts")
    args = parser.parse_args()
    import openai  # noqa: F401 - imported before the clocks start: a run pays it once, not per call

    await measure("agent", "zero", 1, args.turns)  # warm: first-use costs (imports, jinja, the pool)
    await measure("loopback", "zero", 1, args.turns)
    out: dict[str, Any] = {"load_average_before": os.getloadavg()}
    for latency in [*LATENCY] if args.latency == "all" else [args.latency]:
        native = await measure("native", latency, args.steps, args.turns)
        agent = await measure("agent", latency, args.steps, args.turns)
        loopback = await measure("loopback", latency, args.steps, args.turns)
        row = out[latency] = {"call_ms": call_ms(latency), "native": native, "agent": agent, "loopback": loopback}
        for name, got in (("agent", agent), ("loopback", loopback)):
            row[f"{name}_ratio_per_turn"] = got["wall_ms_per_turn"] / native["wall_ms_per_turn"]
            row[f"{name}_cpu_ms_per_call"] = got["cpu_ms_per_turn"] - native["cpu_ms_per_turn"]
        print(f"{latency} (a call {row['call_ms']:.0f} ms): native {native['wall_ms_per_turn']:.2f} ms/turn "
              f"({native['cpu_ms_per_turn']:.2f} CPU); in process {agent['wall_ms_per_turn']:.2f} "
              f"({agent['cpu_ms_per_turn']:.2f} CPU), {row['agent_ratio_per_turn']:.2f}x; loopback "
              f"{loopback['wall_ms_per_turn']:.2f} ({loopback['cpu_ms_per_turn']:.2f} CPU), "
              f"{row['loopback_ratio_per_turn']:.2f}x; calls in flight {native['calls_in_flight']:.1f} / "
              f"{agent['calls_in_flight']:.1f} / {loopback['calls_in_flight']:.1f}, gap between an answer and the "
              f"episode's next call (mean, p90) {native['gap_ms_mean']:.2f}, {native['gap_ms_p90']:.2f} / "
              f"{agent['gap_ms_mean']:.2f}, {agent['gap_ms_p90']:.2f} / {loopback['gap_ms_mean']:.2f}, "
              f"{loopback['gap_ms_p90']:.2f} ms", flush=True)  # fmt: skip
    if not args.no_breakdown:
        out["breakdown"] = await breakdown()
        print("CPU per call: " + ", ".join(f"{k} {v:.2f}" for k, v in out["breakdown"].items()))
    out["load_average_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    asyncio.run(main())

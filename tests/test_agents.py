"""Agents as envs: programs written with the real ``openai`` client train through the endpoint
headrace serves on loopback (``headrace/agents``).

Through ``headrace run`` on the sim backend (and, slow, the tiny torch model): chat completions
with tools, the Responses API, an agent that rewrites its history. Through the endpoint with a
scripted sampler (what a call samples is chosen by the test): tool calls parsed into
``tool_calls`` and ``function_call`` items, a malformed one returned as text, tool results in the
next prompt, routing and auth, the turn limit, a pending call cancelled with its episode, a
sampler error, a plain (sync) agent, a command as the agent, and the group semantics of the
rollout actor (retries, a spent budget cancelling the group's pending calls, timeouts).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from headrace.agents import AgentEpisode, AgentResult, command_agent
from headrace.agents.endpoint import AgentEndpoint
from headrace.agents.env import AgentEnv, AgentGroup
from headrace.app.cli import main
from headrace.core.channel import Channel
from headrace.core.datums import trajectory_to_datums
from headrace.core.episode import EpisodeSpec, PromptTooLongError, run_episode
from headrace.core.rollout import RetrySettings, RolloutActor, RolloutItem
from headrace.core.sampler import SamplerActor
from headrace.core.types import DroppedGroup, GroupKey, SampledTokens, SamplerHandle, SamplingParams, StopReason
from headrace.renderers import renderer_for
from headrace.tokenizers.char import CharTokenizer
from tests import agent_envs

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).resolve().parent
QUICK = ["--steps", "2", "--batch-size", "2", "--group-size", "2", "--no-progress"]
QUICK += ["--set", "advantages.filter_constant=false"]
TOK = CharTokenizer()
EOS = TOK.eos_token_id


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_cli(tmp_path: Path, env: str, *extra: str, capsys=None) -> list[dict]:
    run_dir = tmp_path / env
    args = ["run", "--env", f"{HERE / 'agent_envs.py'}:{env}", "--run-dir", str(run_dir), *QUICK, *extra]
    assert main(args) == 0, capsys.readouterr().err if capsys else ""
    return rows(run_dir)


# ---- headrace run, sim backend --------------------------------------------------------------


def test_a_tool_using_chat_agent_trains_through_headrace_run(tmp_path, capsys):
    for row in run_cli(tmp_path, "tools", "--backend", "sim", capsys=capsys):
        assert row["env/all/agent/calls_per_episode"] == 3.0
        # each call sent back the SDK's own message object: its prompt continues the last one exactly
        assert row["env/all/agent/prefix_extension_rate"] == 1.0 and row["env/all/agent/sequences"] == 1.0
        assert row["env/all/agent/tokens_rerendered"] == 0.0 and row["env/tools/agent_turns"] == 3.0
        assert row["optim/datums"] == 4.0 and row["groups/trained"] == 2.0  # one sequence per episode


def test_a_responses_api_agent_trains_through_headrace_run(tmp_path, capsys):
    for row in run_cli(tmp_path, "responses", "--backend", "sim", capsys=capsys):
        assert row["env/all/agent/calls_per_episode"] == 3.0
        assert row["env/all/agent/prefix_extension_rate"] == 1.0  # previous_response_id continues the tokens
        assert row["optim/datums"] == 4.0


def test_an_agent_that_rewrites_its_history_trains_two_sequences_per_episode(tmp_path, capsys):
    for row in run_cli(tmp_path, "rewrites", "--backend", "sim", capsys=capsys):
        assert row["env/all/agent/calls_per_episode"] == 3.0 and row["env/all/agent/sequences"] == 2.0
        assert row["env/all/agent/prefix_extension_rate"] == 0.5 and row["env/all/agent/tokens_rerendered"] > 0
        assert row["optim/datums"] == 8.0  # 4 episodes, 2 sequences each


def test_an_agent_that_raises_is_retried_against_the_budget(tmp_path, capsys):
    got = run_cli(tmp_path, "flaky", "--backend", "sim", "--set", "env_options.fail_every=3", capsys=capsys)
    assert sum(row.get("rollout_errors/AgentFailed", 0) for row in got[-1:]) >= 1
    assert all(row["groups/dropped"] == 0 for row in got)


@pytest.mark.slow
def test_the_cli_runs_an_agent_env_in_a_subprocess(tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "headrace", "run", "--env", f"{HERE / 'agent_envs.py'}:tools", "--backend", "sim"]
    done = subprocess.run([*args, "--run-dir", str(run_dir), *QUICK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [row["env/all/agent/calls_per_episode"] for row in rows(run_dir)] == [3.0, 3.0]


@pytest.mark.slow
@pytest.mark.parametrize("env", ["tools", "responses", "rewrites"])
def test_agents_train_on_the_tiny_torch_model(tmp_path, capsys, env):
    got = run_cli(tmp_path, env, "--backend", "torch", "--model", "tiny", "--max-tokens", "24", capsys=capsys)
    assert len(got) == 2 and all(row["env/all/agent/calls_per_episode"] == 3.0 for row in got)
    assert all(row["optim/datums"] >= 4.0 for row in got)


# ---- the endpoint, with a scripted sampler ----------------------------------------------------


class Script:
    """A sampler whose n-th call returns the n-th reply (text in the tiny alphabet, closed by EOS)."""

    def __init__(self, *replies: str, hold: int | None = None, close: bool = True):
        self.replies, self.calls, self.prompts, self.close = list(replies), 0, [], close
        self.hold = hold  # this call waits until cancelled
        self.held, self.cancelled = asyncio.Event(), asyncio.Event()

    async def __call__(self, prompt, n, params):
        self.prompts.append(list(prompt))
        i, self.calls = self.calls, self.calls + 1
        if i == self.hold:
            self.held.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        tokens = TOK.encode(self.replies[i % len(self.replies)]) + [EOS] * self.close
        return [SampledTokens(tokens, [-0.5] * len(tokens), StopReason.STOP if self.close else StopReason.LENGTH, 0)]


def endpoint(max_tokens: int = 32) -> AgentEndpoint:
    return AgentEndpoint(renderer_for("tiny", TOK), TOK, max_tokens, "tiny")


SPEC = EpisodeSpec(SamplingParams(max_tokens=32), max_turns=8, seed=0, vocab_size=TOK.vocab_size)


async def drive(agent, sample, problem=(2, 3), spec=SPEC, where=None):
    return await run_episode(AgentEnv(agent, problem, where or endpoint()), sample, spec, seed=1)


async def test_tool_calls_come_back_parsed_and_their_results_reach_the_next_prompt():
    seen = {}

    async def agent(episode: AgentEpisode) -> float:
        client = episode.openai()
        messages = [{"role": "user", "content": "what is 2+3?"}]
        first = await client.chat.completions.create(model="any-name", messages=messages, tools=agent_envs.TOOLS)
        seen["first"] = first
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        second = await client.chat.completions.create(model="any-name", messages=messages, tools=agent_envs.TOOLS)
        seen["second"] = second
        return float(second.choices[0].message.content == "5")

    script = Script("<call>add(a=2,b=3)</call>", "5")
    trajectory = await drive(agent, script)
    first = seen["first"].choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in first.message.tool_calls] == [
        ("add", {"a": 2, "b": 3})
    ]
    assert seen["second"].choices[0].finish_reason == "stop" and trajectory.total_reward == 1.0
    assert "tools: add(a,b) add two numbers" in TOK.decode(script.prompts[0])
    second_prompt = trajectory.transitions[1].observation
    assert TOK.decode(second_prompt).endswith("t:5a:")  # the tool's result, then the next turn
    first_turn = trajectory.transitions[0]
    assert second_prompt[: len(first_turn.observation) + len(first_turn.action.tokens)] == (
        first_turn.observation + first_turn.action.tokens
    )
    metrics = trajectory.transitions[-1].metrics
    assert metrics["agent/tool_calls"] == 1.0 and metrics["agent/prefix_extension_rate"] == 1.0


async def test_a_malformed_call_is_text_with_finish_stop_and_is_counted():
    got = {}

    async def agent(episode: AgentEpisode) -> float:
        response = await episode.openai().chat.completions.create(
            model=episode.model, messages=[{"role": "user", "content": "2+3?"}], tools=agent_envs.TOOLS
        )
        got["choice"] = response.choices[0]
        return 0.0

    trajectory = await drive(agent, Script("<call>divide(a=1)</call>"))
    assert got["choice"].finish_reason == "stop" and got["choice"].message.tool_calls is None
    assert got["choice"].message.content == "<call>divide(a=1)</call>"
    assert trajectory.transitions[-1].metrics["agent/invalid_tool_calls"] == 1.0


async def test_the_responses_api_gives_function_calls_and_takes_their_outputs():
    got = {}

    async def agent(episode: AgentEpisode) -> float:
        client = episode.openai()
        first = await client.responses.create(
            model=episode.model, input="what is 2+3?", instructions="add.", tools=agent_envs.RESPONSE_TOOLS
        )
        calls = [item for item in first.output if item.type == "function_call"]
        outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "5"} for c in calls]
        second = await client.responses.create(  # instructions are not carried over: given again
            model=episode.model, previous_response_id=first.id, input=outputs, instructions="add.",
            tools=agent_envs.RESPONSE_TOOLS,
        )  # fmt: skip
        got.update(first=first, calls=calls, second=second)
        stream = await client.responses.create(model=episode.model, input="again?", stream=True)
        got["events"] = [event.type async for event in stream]
        return float(second.output_text == "5")

    script = Script("<call>add(a=2,b=3)</call>", "5", "7")
    trajectory = await drive(agent, script)
    assert [(c.name, json.loads(c.arguments)) for c in got["calls"]] == [("add", {"a": 2, "b": 3})]
    assert got["first"].status == "completed" and got["second"].output_text == "5"
    assert trajectory.total_reward == 1.0 and TOK.decode(script.prompts[1]).endswith("t:5a:")
    assert got["events"][0] == "response.created" and got["events"][-1] == "response.completed"
    assert "response.output_text.delta" in got["events"]
    # the second response continued the first's tokens; the stream started a conversation of its own
    assert trajectory.transitions[-1].metrics["agent/sequences"] == 2.0


async def test_streamed_chat_completions_carry_tool_calls():
    got = {}

    async def agent(episode: AgentEpisode) -> float:
        stream = await episode.openai().chat.completions.create(
            model=episode.model, messages=[{"role": "user", "content": "2+3?"}], tools=agent_envs.TOOLS, stream=True
        )
        got["chunks"] = [chunk async for chunk in stream]
        return 0.0

    await drive(agent, Script("<call>mul(a=2,b=3)</call>"))
    deltas = [c.choices[0].delta for c in got["chunks"] if c.choices]
    calls = [call for d in deltas for call in d.tool_calls or ()]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("mul", {"a": 2, "b": 3})]
    assert got["chunks"][-1].choices[0].finish_reason == "tool_calls"


async def test_text_completions_continue_their_tokens_and_take_token_ids():
    got = {}

    async def agent(episode: AgentEpisode) -> float:
        client = episode.openai()
        first = await client.completions.create(model=episode.model, prompt="2+3=", max_tokens=4, logprobs=1)
        second = await client.completions.create(model=episode.model, prompt=f"2+3={first.choices[0].text}, 4+4=")
        ids = await client.completions.create(model=episode.model, prompt=TOK.encode("1+1="))
        got.update(first=first, second=second, ids=ids)
        return 1.0

    script = Script("5", "8", "2", close=False)  # cut by max_tokens: no stop token the text leaves out
    trajectory = await drive(agent, script)
    first = got["first"].choices[0]
    assert first.text == "5" and first.finish_reason == "length" and first.logprobs.tokens == ["5"]
    assert got["second"].choices[0].text == "8" and got["ids"].choices[0].text == "2"
    assert TOK.decode(script.prompts[1]) == "2+3=5, 4+4=" and TOK.decode(script.prompts[2]) == "1+1="
    metrics = trajectory.transitions[-1].metrics
    assert metrics["agent/calls_per_episode"] == 3.0 and metrics["agent/sequences"] == 2.0


async def test_calls_are_routed_to_their_own_episode_and_need_the_runs_key():
    where = endpoint()
    urls = {}

    async def agent(episode: AgentEpisode) -> float:
        a, b = episode.problem
        urls[episode.problem] = episode.base_url
        for _ in range(2):
            await anyio.sleep(0.01)
            await episode.openai().chat.completions.create(
                model=episode.model, messages=[{"role": "user", "content": f"{a}+{b}"}]
            )
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=episode.base_url, api_key="wrong", max_retries=0).models.list()
        return 1.0

    async with where.lifespan():  # one server for all, as a run has it
        results = {}

        async def one(problem):
            results[problem] = await drive(agent, Script("1"), problem, where=where)

        async with anyio.create_task_group() as tg:
            for problem in agent_envs.PROBLEMS:
                tg.start_soon(one, problem)
        for (a, b), trajectory in results.items():  # each episode saw only its own calls
            assert all(TOK.decode(t.observation).startswith(f"u:{a}+{b}") for t in trajectory.transitions)
        assert len({url.rsplit("/agents/", 1)[0] for url in urls.values()}) == 1  # one port
        late = openai.AsyncOpenAI(base_url=urls[(2, 3)], api_key=where.key, max_retries=0)
        with pytest.raises(openai.NotFoundError) as caught:  # its episode is over
            await late.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert caught.value.body["code"] == "episode_not_found"


async def test_in_process_and_loopback_calls_get_the_same_answers_and_refusals():
    """``episode.openai()`` hands its calls to the endpoint in process; ``loopback=True`` sends
    them over the socket: the same completion, the same 401, and the client's timeout holds."""
    where = endpoint()
    got = {}

    async def agent(episode: AgentEpisode) -> float:
        ask = {"model": episode.model, "messages": [{"role": "user", "content": "2+3"}], "logprobs": True}
        inside = await episode.openai().chat.completions.create(**ask)
        wire = await episode.openai(loopback=True).chat.completions.create(**ask)
        got["answers"] = [
            (r.choices[0].message.content, r.choices[0].logprobs.content[0].logprob) for r in (inside, wire)
        ]
        for http in (episode.http_client, episode.loopback_http_client):
            wrong = openai.AsyncOpenAI(base_url=episode.base_url, api_key="wrong", max_retries=0, http_client=http)
            with pytest.raises(openai.AuthenticationError):
                await wrong.models.list()
        with pytest.raises(openai.APITimeoutError):  # the third call is held by the sampler
            await episode.openai(timeout=0.2).chat.completions.create(**ask)
        return 1.0

    async with where.lifespan():
        trajectory = await drive(agent, Script("5", "5", hold=2), where=where)
    assert got["answers"] == [("5", -0.5), ("5", -0.5)]
    assert len(trajectory.transitions) == 2  # the timed-out call's sampling was cancelled, not recorded


async def test_messages_sent_in_extra_body_are_the_same_call():
    """docs/agents.md: an agent may skip the SDK's request transform (most of a call's CPU) by
    sending its messages in ``extra_body``: the endpoint renders the same prompts."""
    sample = Script("5", "7", "5", "7")

    async def agent(episode: AgentEpisode, fast: bool) -> float:
        client, history = episode.openai(), [{"role": "user", "content": "2+3"}]
        for _ in range(2):
            if fast:
                reply = await client.chat.completions.create(model="t", messages=[], extra_body={"messages": history})
            else:
                reply = await client.chat.completions.create(model="t", messages=history)
            said = reply.choices[0].message.content
            history += [{"role": "assistant", "content": said}, {"role": "user", "content": "+2"}]
        return 1.0

    where = endpoint()
    async with where.lifespan():
        plain = await drive(functools.partial(agent, fast=False), sample, where=where)
        fast = await drive(functools.partial(agent, fast=True), sample, where=where)
    # the same two prompts, the second (a continuation of the first call's tokens) included
    assert sample.prompts[:2] == sample.prompts[2:] and len(plain.transitions) == len(fast.transitions) == 2


async def test_the_runs_shared_client_carries_no_cookie_from_one_episode_to_another():
    """The agents' clients share one httpx client: a cookie a response set would be sent on every
    episode's calls. The endpoint sets none, and the shared client keeps none."""
    from headrace.agents.endpoint import LIMITS, shared_http_client
    from headrace.net.http import Response
    from headrace.net.inprocess import InProcessTransport

    sent = []

    async def handler(request):
        sent.append(request.headers.get("cookie"))
        answer = Response.of_json({})
        answer.headers["set-cookie"] = "episode=a; Path=/"
        return answer

    client = shared_http_client(InProcessTransport(handler, LIMITS, "a handler"))
    for episode in ("a", "b"):
        assert (await client.get(f"http://127.0.0.1/agents/{episode}/v1/models")).status_code == 200
    assert sent == [None, None] and len(client.cookies) == 0
    with pytest.raises(TypeError, match="keeps no cookies"):
        client.cookies = {"episode": "a"}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("responses", {"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0]"),
        ("responses", {"input": [{"type": "image_generation_call"}]}, 400, "input[0]"),
        ("responses", {"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
        ("responses", {"input": "hi", "text": {"format": {"type": "json_schema"}}}, 400, "text.format"),
        ("responses", {"input": "hi", "background": True}, 400, "background"),
        ("responses", {"input": []}, 400, "input"),
        ("completions", {"prompt": ""}, 400, "prompt"),
        ("completions", {"prompt": "a", "echo": True}, 400, "echo"),
        ("completions", {"prompt": "a", "logprobs": 5}, 400, "logprobs"),
        ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "tool_choice": "required"}, 400,
         "tool_choice"),
        ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 3}, 400, "n"),
    ],
)  # fmt: skip
async def test_a_bad_call_gets_an_openai_error_naming_what_is_wrong_and_the_episode_goes_on(path, body, status, param):
    got = {}

    async def agent(episode: AgentEpisode) -> float:
        async with httpx.AsyncClient(headers={"authorization": f"Bearer {episode.api_key}"}) as http:
            got["bad"] = await http.post(f"{episode.base_url}/{path}", json={"model": "t", **body})
            got["unauthorised"] = await http.post(
                f"{episode.base_url}/{path}", json=body, headers={"authorization": ""}
            )
            got["get"] = await http.get(f"{episode.base_url}/{path}")
            got["nowhere"] = await http.get(episode.base_url.replace("/agents/", "/nowhere/") + "/models")
        reply = await episode.openai().chat.completions.create(model="t", messages=[{"role": "user", "content": "a"}])
        return float(reply.choices[0].message.content == "1")

    trajectory = await drive(agent, Script("1"))
    error = got["bad"].json()["error"]
    assert (got["bad"].status_code, error["param"]) == (status, param) and error["message"], error
    assert got["unauthorised"].status_code == 401 and got["get"].status_code == 405
    assert got["nowhere"].status_code == 404 and "/agents/<episode>/v1" in got["nowhere"].json()["error"]["message"]
    assert trajectory.total_reward == 1.0 and len(trajectory.transitions) == 1  # refused calls are no turns


async def test_a_call_still_waiting_when_its_episode_ends_is_cancelled_and_told_so():
    script = Script("1", hold=1)
    pending = {}

    async def agent(episode: AgentEpisode) -> float:
        await episode.openai().chat.completions.create(model="t", messages=[{"role": "user", "content": "a"}])
        # a client of its own (episode.openai()'s are closed with the episode), left waiting
        client = openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0)
        pending["call"] = asyncio.ensure_future(
            client.chat.completions.create(model=episode.model, messages=[{"role": "user", "content": "b"}])
        )
        await script.held.wait()
        return 1.0  # returns with a call in flight

    trajectory = await drive(agent, script)
    assert script.cancelled.is_set() and len(trajectory.transitions) == 1
    with pytest.raises(openai.APIStatusError) as caught:
        await pending["call"]
    assert caught.value.status_code == 410 and caught.value.body["code"] == "episode_ended"


async def test_past_the_turn_limit_a_call_is_refused_and_the_episode_ends_unfinished():
    async def agent(episode: AgentEpisode) -> float:
        client = episode.openai()
        while True:  # an agent that never stops on its own
            await client.chat.completions.create(model=episode.model, messages=[{"role": "user", "content": "a"}])

    spec = EpisodeSpec(SamplingParams(max_tokens=32), max_turns=2, seed=0, vocab_size=TOK.vocab_size)
    trajectory = await drive(agent, Script("1"), spec=spec)
    assert trajectory.stop_reason == StopReason.MAX_TURNS and len(trajectory.transitions) == 2
    metrics = trajectory.transitions[-1].metrics
    assert trajectory.total_reward == 0.0 and metrics["agent/max_turns"] == 1.0 and metrics["agent/unfinished"] == 1.0


async def test_a_sampler_error_fails_the_episode_with_its_own_cause():
    class SamplerDown(RuntimeError):
        pass

    async def broken(prompt, n, params):
        raise SamplerDown("the sampler is down")

    async def agent(episode: AgentEpisode) -> float:
        try:
            await episode.openai().chat.completions.create(model="t", messages=[{"role": "user", "content": "a"}])
        except openai.APIError:
            return 1.0  # an agent that swallows the error cannot hide it
        return 0.0

    with pytest.raises(SamplerDown):
        await drive(agent, broken)


async def test_a_first_prompt_too_long_for_the_context_is_the_runs_error():
    async def too_long(prompt, n, params):
        raise PromptTooLongError(len(prompt), 8)

    async def agent(episode: AgentEpisode) -> float:
        await episode.openai().chat.completions.create(model="t", messages=[{"role": "user", "content": "a" * 50}])
        return 1.0

    with pytest.raises(PromptTooLongError):
        await drive(agent, too_long)


async def test_stitching_a_rewritten_history_gives_two_sequences_with_the_episodes_advantage():
    trajectory = await drive(agent_envs.rewriting_agent, Script("5", "5", "5"))
    datums = trajectory_to_datums(trajectory, advantage=0.75)
    assert len(datums) == 2  # the two continuing calls in one sequence, the rewritten one in another
    first, second = datums
    assert (first.num_loss_tokens, second.num_loss_tokens) == (4, 2)  # "5" + EOS per call
    assert {a for d in datums for a, m in zip(d.advantages, d.mask, strict=True) if m} == {0.75}
    assert TOK.decode(second.model_input).startswith("u:earlier you said 5")


async def test_a_plain_function_with_the_sync_client_runs_in_a_thread():
    def agent(episode: AgentEpisode) -> AgentResult:
        client = openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0)
        reply = client.chat.completions.create(model=episode.model, messages=[{"role": "user", "content": "2+3"}])
        return AgentResult(answer=reply.choices[0].message.content)

    env = AgentEnv(agent, (2, 3), endpoint(), grade=lambda problem, answer: float(answer == "5"))
    trajectory = await run_episode(env, Script("5"), SPEC, seed=1)
    assert trajectory.total_reward == 1.0


async def test_a_command_is_an_agent(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, os
            import openai
            a, b = json.loads(os.environ["HEADRACE_PROBLEM"])
            client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
            reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"],
                                                   messages=[{"role": "user", "content": f"{a}+{b}"}])
            print("thinking...")
            print(json.dumps({"reward": float(reply.choices[0].message.content == str(a + b)), "metrics": {"x": 2}}))
            """
        )
    )
    env = AgentEnv(command_agent([sys.executable, str(script)]), (2, 3), endpoint())
    trajectory = await run_episode(env, Script("5"), SPEC, seed=1)
    assert trajectory.total_reward == 1.0 and trajectory.transitions[-1].metrics["x"] == 2


# ---- group semantics, through the rollout actor ------------------------------------------------


class Held:
    """A sampling backend: member prompts holding 'slow' wait until cancelled; the rest answer."""

    def __init__(self):
        self.cancelled = 0

    async def sample(self, handle, prompt, n, params):
        if "slow" in TOK.decode(prompt):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        tokens = TOK.encode("1") + [EOS]
        return [SampledTokens(tokens, [-0.1] * len(tokens), StopReason.STOP, 0) for _ in range(n)]


async def roll(agent, budget: int, timeout_s: float | None = None, group_size: int = 2):
    backend = Held()
    sampler = SamplerActor(backend, SamplerHandle(0))
    inbox: Channel[RolloutItem] = Channel(1, "rollout")
    outbox: Channel = Channel(1, "reward")
    actor = RolloutActor(inbox, outbox, sampler, SPEC, RetrySettings(budget, timeout_s, False), workers=1)
    where = endpoint()
    builder = AgentGroup(agent, "p", where, group_size)
    async with where.lifespan():
        group = await actor.rollout_group(RolloutItem(GroupKey(0, 0), builder, 1))
    return group, actor, backend


async def test_a_spent_budget_cancels_the_groups_pending_calls():
    started = {"n": 0}

    async def agent(episode: AgentEpisode) -> float:
        started["n"] += 1
        client = episode.openai()
        if started["n"] == 1:  # the first member waits on a call that only a cancellation ends
            await client.chat.completions.create(model="t", messages=[{"role": "user", "content": "slow"}])
            return 1.0
        await client.chat.completions.create(model="t", messages=[{"role": "user", "content": "fast"}])
        raise agent_envs.AgentFailed("gives up")

    group, actor, backend = await roll(agent, budget=0)
    assert isinstance(group, DroppedGroup) and actor.error_counts["AgentFailed"] == 1
    assert backend.cancelled == 1  # the waiting member's sample call was cancelled with its group


async def test_an_agent_that_times_out_is_retried_then_its_group_dropped():
    async def agent(episode: AgentEpisode) -> float:
        await episode.openai().chat.completions.create(model="t", messages=[{"role": "user", "content": "slow"}])
        return 1.0

    group, actor, backend = await roll(agent, budget=1, timeout_s=0.5, group_size=1)
    assert isinstance(group, DroppedGroup) and actor.error_counts["TimeoutError"] == 2
    assert backend.cancelled == 2


async def test_a_group_of_agents_gets_rewards_per_member():
    async def agent(episode: AgentEpisode) -> float:
        reply = await episode.openai().chat.completions.create(
            model="t", messages=[{"role": "user", "content": "fast"}]
        )
        return float(reply.choices[0].message.content == "1")

    group, actor, _ = await roll(agent, budget=0, group_size=3)
    assert not isinstance(group, DroppedGroup)
    assert group.rewards_G == [1.0, 1.0, 1.0] and group.metrics["agent/calls_per_episode"] == 1.0


async def test_a_run_serves_all_its_episodes_from_one_endpoint_it_closes_at_the_end(tmp_path):
    from headrace.agents import agent_env
    from headrace.envs.context import EnvContext
    from headrace.run.config import RunConfig
    from headrace.run.train import train

    seen: list[str] = []

    async def agent(episode: AgentEpisode) -> float:
        seen.append(episode.base_url)
        await episode.openai().chat.completions.create(model="t", messages=[{"role": "user", "content": "hi"}])
        return float(len(seen) % 2)

    ctx = EnvContext(tokenizer=TOK, group_size=2, batch_size=2, steps=2, seed=0, max_tokens=4)
    dataset = agent_env(ctx, agent, ["p"])
    config = RunConfig(env="arithmetic", backend="sim", steps=2, batch_size=2, group_size=2, run_dir=str(tmp_path),
                       advantages={"filter_constant": False})  # fmt: skip
    await train(config, dataset=dataset)
    ports = {url.split("/agents/")[0] for url in seen}
    assert len(seen) == 8 and len(ports) == 1 and len(set(seen)) == 8  # one server, an episode a path
    with pytest.raises(httpx.ConnectError):  # the run is over, and so is its server
        httpx.get(f"{ports.pop()}/healthz")


async def test_a_run_of_agents_that_fails_raises_its_own_error_not_a_group(tmp_path):
    """The endpoint's task group is left by the run's error: train() raises that error (a
    HeadraceError the caller can catch), not an ExceptionGroup around it."""
    import headrace
    from headrace.agents import agent_env
    from headrace.core.rollout import TooManyDroppedGroups
    from headrace.envs.context import EnvContext
    from headrace.run.config import RunConfig
    from headrace.run.train import train

    async def agent(episode: AgentEpisode) -> float:
        await episode.openai().chat.completions.create(model="t", messages=[{"role": "user", "content": "hi"}])
        raise RuntimeError("the agent broke")

    ctx = EnvContext(tokenizer=TOK, group_size=2, batch_size=2, steps=2, seed=0, max_tokens=4)
    config = RunConfig(env="arithmetic", backend="sim", steps=2, batch_size=2, group_size=2, run_dir=str(tmp_path),
                       retry={"budget": 0, "max_consecutive_dropped": 2})  # fmt: skip
    with pytest.raises(headrace.HeadraceError) as caught:
        await train(config, dataset=agent_env(ctx, agent, ["p"]))
    assert type(caught.value) is TooManyDroppedGroups, repr(caught.value)
    assert "the agent broke" in str(caught.value)


@pytest.mark.parametrize(
    ("outcome", "grade", "error"),
    [(None, None, "return a reward"), (float("nan"), None, "must be finite"), ("5", None, "grade(problem, answer)"),
     ("5", lambda problem, answer: "yes", "must return a number")],
)  # fmt: skip
async def test_an_agent_that_returns_no_reward_is_told_how_to_give_one(outcome, grade, error):
    from headrace.core.episode import EnvContractError

    async def agent(episode: AgentEpisode):
        await episode.openai().chat.completions.create(model="t", messages=[{"role": "user", "content": "a"}])
        return outcome

    with pytest.raises(EnvContractError, match=re.escape(error)):
        await run_episode(AgentEnv(agent, (2, 3), endpoint(), grade), Script("1"), SPEC, seed=1)


async def test_an_async_grade_scores_the_answer_and_an_agent_without_calls_is_an_error():
    from headrace.core.episode import NoTurnsError

    async def agent(episode: AgentEpisode) -> AgentResult:
        reply = await episode.openai().chat.completions.create(model="t", messages=[{"role": "user", "content": "a"}])
        return AgentResult(answer=reply.choices[0].message.content, metrics={"mine": 3.0})

    async def grade(problem, answer):
        return float(answer == "5")

    trajectory = await run_episode(AgentEnv(agent, (2, 3), endpoint(), grade), Script("5"), SPEC, seed=1)
    assert trajectory.total_reward == 1.0 and trajectory.transitions[-1].metrics["mine"] == 3.0

    async def idle(episode: AgentEpisode) -> float:
        return 1.0

    with pytest.raises(NoTurnsError):
        await run_episode(AgentEnv(idle, (2, 3), endpoint()), Script("5"), SPEC, seed=1)


# ---- --cluster ray ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_agents_run_on_ray_rollout_workers_with_their_endpoint_there(tmp_path, capsys, ray_instance):
    """Under ``--cluster ray`` each agent runs on a rollout worker, its endpoint on that worker's
    loopback; its turns are sampled from the driver (through the sampler replica). The same
    stitching as in one process."""
    ray = ["--backend", "sim", "--set", "cluster.kind=ray", "--set", "cluster.rollout_workers=2"]
    ray += ["--set", "cluster.sampler_replicas=1"]
    for row in run_cli(tmp_path, "tools", *ray, capsys=capsys):
        assert row["env/all/agent/calls_per_episode"] == 3.0 and row["env/all/agent/prefix_extension_rate"] == 1.0
        assert row["optim/datums"] == 4.0 and row["groups/trained"] == 2.0
        # no turn failed: a turn's prompt that arrives before the driver recorded the last one passes
        assert row.get("rollout_errors/total", 0.0) == 0.0, row

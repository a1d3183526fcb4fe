"""The message-level env bases: a ProblemEnv graded on its answer text, a MessageEnv whose next
observation extends the previous prompt + sampled tokens exactly, both driven by hand and
through the engine (sim, and the embedded tiny model on the torch backend)."""

from __future__ import annotations

import pickle

import pytest

from headrace.core.datums import trajectory_to_datums
from headrace.core.episode import EpisodeSpec, run_episode
from headrace.core.types import SampledTokens, SamplingParams, StopReason
from headrace.envs.base import GroupOf, ProblemDataset
from headrace.envs.context import EnvContext
from headrace.envs.message import MessageEnv, MessageStep, ProblemEnv, Verdict
from headrace.run.train import train
from tests.env_helpers import action, chatml_renderer, drive, encode, run_config, tiny_renderer


class Sum(ProblemEnv):
    def __init__(self, a: int, b: int, renderer, max_tokens: int = 8, format_coef: float = 0.0):
        prefix = [{"role": "system", "content": "be brief"}]
        super().__init__(renderer, max_tokens, prefix=prefix, format_coef=format_coef)
        self.a, self.b = a, b

    def question(self) -> str:
        return f"{self.a}+{self.b}=?"

    async def check_answer(self, text: str) -> Verdict:
        return Verdict(float(text.strip() == str(self.a + self.b)), {"long": float(len(text) > 2)})

    def check_format(self, text: str) -> bool:
        return text.strip().isdigit()


class Countdown(MessageEnv):
    """Say the numbers from n down to 1, one a turn; the env answers each with "next"."""

    def __init__(self, n: int, renderer, max_tokens: int = 8, max_turns: int | None = None):
        super().__init__(renderer, max_tokens, max_turns)
        self.n = n

    def initial_messages(self):
        return [{"role": "user", "content": f"count down from {self.n}"}]

    async def respond(self, text: str, clean: bool) -> MessageStep:
        expected = self.n - self.turns + 1
        if text.strip() != str(expected):
            return MessageStep(0.0, done=True, metrics={"reached": float(self.turns - 1)})
        if expected == 1:
            return MessageStep(1.0, done=True, metrics={"reached": float(self.turns)})
        return MessageStep(0.1, messages=["next"])


RENDERERS = [pytest.param(tiny_renderer, id="tiny"), pytest.param(chatml_renderer, id="chatml")]


@pytest.mark.parametrize("make_renderer", RENDERERS)
async def test_problem_env_grades_the_answer_text_and_its_format(make_renderer):
    r = make_renderer()
    env = Sum(2, 3, r, format_coef=0.2)
    prompt, stop = await env.initial_observation()
    assert prompt == r.build_generation_prompt(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3=?"}]
    )
    assert stop.stop_token_ids == r.stop_token_ids and stop.max_tokens == 8
    right = await env.step(action(r, "5"))
    assert right.done and right.reward == 1.0
    assert right.metrics == {"truncated": 0.0, "correct": 1.0, "format_ok": 1.0, "long": 0.0}
    # (reply, ended at the stop token, reward, truncated): a cut-off or malformed answer costs format_coef
    for text, close, reward, truncated in [("5", False, 0.8, 1.0), ("five", True, -0.2, 0.0)]:
        env = Sum(2, 3, r, format_coef=0.2)
        await env.initial_observation()
        result = await env.step(action(r, text, close=close))
        assert result.done and result.reward == pytest.approx(reward), text
        assert result.metrics["truncated"] == truncated and result.metrics["format_ok"] == 0.0


@pytest.mark.parametrize("make_renderer", RENDERERS)
async def test_message_env_extends_the_previous_prompt_and_sample_exactly(make_renderer):
    r = make_renderer()
    env = Countdown(3, r)
    observations, actions, results = await drive(env, r, ["3", "2", "1"])
    assert [x.reward for x in results] == [0.1, 0.1, 1.0] and results[-1].done
    for prev, act, nxt in zip(observations, actions, observations[1:], strict=False):
        assert nxt[: len(prev) + len(act.tokens)] == prev + act.tokens  # nothing sampled re-tokenised
    # and the last observation is the whole conversation rendered afresh: no drift
    assert observations[-1] == r.build_generation_prompt(env.messages[:-1])
    assert [m["role"] for m in env.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert env.messages[-1]["content"] == "1" and results[-1].metrics == {"truncated": 0.0, "reached": 3.0}


class Echo(MessageEnv):
    """Answers every turn with "ok", whatever was said, until ``max_turns``."""

    def initial_messages(self):
        return [{"role": "user", "content": "talk"}]

    async def respond(self, text: str, clean: bool) -> MessageStep:
        return MessageStep(messages=[{"role": "user", "content": "ok"}])


@pytest.mark.parametrize("make_renderer", RENDERERS)
async def test_sampled_tokens_that_retokenise_differently_are_kept_as_sampled(make_renderer):
    r = make_renderer()
    if r.name == "tiny":  # an id that decodes to nothing (as the sim's version stamps do)
        odd = [1_000_000, *encode(r, "hi")]
    else:  # "<|im_start|>" spelt in bytes: decoded and encoded again, it would become the special token
        odd = encode(r, "<") + encode(r, "|im_start|>hi")
        assert encode(r, r.hf.decode(odd)) != odd
    env = Echo(r, 8, max_turns=3)
    observation, _ = await env.initial_observation()
    for _ in range(2):
        sampled = odd + list(r.end_of_turn)
        result = await env.step(SampledTokens(sampled, [0.0] * len(sampled), StopReason.STOP))
        assert result.next_observation[: len(observation) + len(sampled)] == observation + sampled
        observation = result.next_observation
    assert observation != r.build_generation_prompt(env.messages)  # what re-rendering the text would give


async def test_a_cut_off_turn_is_closed_and_the_conversation_goes_on():
    r = tiny_renderer()
    env = Countdown(2, r)
    prompt, _ = await env.initial_observation()
    cut = action(r, "2", close=False)
    result = await env.step(cut)
    assert not result.done and result.metrics["truncated"] == 1.0
    assert result.next_observation[: len(prompt) + 2] == prompt + cut.tokens + list(r.end_of_turn)


async def test_max_turns_ends_the_episode_and_says_so():
    r = tiny_renderer()
    env = Countdown(5, r, max_turns=2)
    _, _, results = await drive(env, r, ["5", "4", "3"])
    assert len(results) == 2 and results[-1].done and results[-1].metrics["turn_limit"] == 1.0


async def test_initial_observation_starts_over_when_asked_again():
    r = tiny_renderer()
    env = Countdown(3, r)
    first, _ = await env.initial_observation()
    await env.step(action(r, "3"))
    again, _ = await env.initial_observation()  # the engine asks again when a group's prompts differ
    assert again == first and env.turns == 0 and len(env.messages) == 1
    assert (await env.step(action(r, "3"))).reward == 0.1


async def test_a_multi_turn_episode_trains_as_one_sequence():
    r = tiny_renderer()
    replies = iter(["3", "2", "1"])

    async def sample(prompt, n, params: SamplingParams):
        tokens = encode(r, next(replies)) + list(r.end_of_turn)
        return [SampledTokens(tokens, [-0.5] * len(tokens), StopReason.STOP)]

    trajectory = await run_episode(Countdown(3, r), sample, EpisodeSpec(SamplingParams(), max_turns=8, seed=0), seed=1)
    assert trajectory.stop_reason == StopReason.DONE and trajectory.total_reward == pytest.approx(1.2)
    (datum,) = trajectory_to_datums(trajectory, advantage=1.0)
    assert datum.num_loss_tokens == 3 * 2  # each reply and its end of turn; the env's tokens masked out


@pytest.mark.parametrize("make_renderer", RENDERERS)
def test_group_builders_round_trip_through_pickle(make_renderer):
    r = make_renderer()
    for builder in (
        GroupOf(Sum, {"a": 1, "b": 2, "renderer": r}, 4, ("sum",)),
        GroupOf(Countdown, {"n": 3, "renderer": r}, 2),
    ):
        clone = pickle.loads(pickle.dumps(builder))
        assert clone.kwargs.keys() == builder.kwargs.keys() and clone.group_size == builder.group_size
        assert clone.kwargs["renderer"].build_generation_prompt(
            [{"role": "user", "content": "hi"}]
        ) == r.build_generation_prompt([{"role": "user", "content": "hi"}])


def _countdown_dataset(ctx: EnvContext) -> ProblemDataset:
    renderer = ctx.renderer

    def group(rng):
        kwargs = {"n": rng.randint(1, 3), "renderer": renderer, "max_tokens": ctx.max_tokens}
        return GroupOf(Countdown, kwargs, ctx.group_size)

    return ProblemDataset(group, ctx.batch_size, ctx.steps, ctx.seed)


@pytest.mark.parametrize("backend", ["sim", "torch"])
async def test_a_message_env_runs_through_the_engine(tmp_path, backend):
    if backend == "torch":
        pytest.importorskip("torch")
    config = run_config(tmp_path, "arithmetic", backend)
    ctx = EnvContext(
        tokenizer=tiny_renderer().tok,
        group_size=config.group_size,
        batch_size=config.batch_size,
        steps=config.steps,
        seed=0,
        max_tokens=config.sampling.max_tokens,
        model="tiny",
    )
    summary = await train(config, dataset=_countdown_dataset(ctx))
    assert summary.steps == 2 and len(summary.metrics) == 2
    assert all("env/all/reached" in row and "env/all/truncated" in row for row in summary.metrics)

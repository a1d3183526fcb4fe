"""An agent is an env: a function that calls an OpenAI-compatible endpoint, trained as one.

``agent_env(ctx, agent, problems)`` is a dataset whose episodes each run ``agent(episode)``: an
async function (or a plain one, run in a thread) given an :class:`AgentEpisode` (the problem, a
``base_url`` and ``api_key`` of its own, the model's name), which makes any number of calls with
the real ``openai`` client (its own loop, its own tools) and returns the reward: a number, an
:class:`AgentResult`, or anything a ``grade(problem, outcome)`` function turns into one.

G episodes of one problem form a group (advantages per group, as for every env); an agent that
raises or times out (``retry.rollout_timeout_s``) is retried with a fresh episode while the
group's retry budget lasts, and when it is spent the group's other episodes are cancelled, their
pending calls with them. The turn limit (``max_turns``) caps the calls of an episode; a call past
it, or one too long for the model's context, is refused (400), and an agent that then gives up
(raises) ends the episode with reward 0 (``agent/max_turns``, ``agent/context_overflow``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import random
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from headrace.core.episode import EnvContractError, Policy
from headrace.core.types import (
    Env,
    EnvGroupBuilder,
    Metrics,
    RLDataset,
    SampledTokens,
    StepResult,
    StopCondition,
)
from headrace.envs.context import EnvContext

from .endpoint import AgentEndpoint

if TYPE_CHECKING:
    import openai


@dataclass(frozen=True)
class AgentEpisode:
    """What an agent gets: its problem, and an endpoint of its own to call."""

    problem: Any
    base_url: str  # http://127.0.0.1:PORT/agents/<episode>/v1, this episode's alone
    api_key: str
    model: str  # the name to send (any name is answered by the run's policy)
    max_tokens: int  # the most a call may sample (sampling.max_tokens)
    # an httpx client that hands calls to the endpoint in this process, for clients on the run's loop
    http_client: Any = field(default=None, repr=False, compare=False)
    loopback_http_client: Any = field(default=None, repr=False, compare=False)  # a pool of the run's, if any
    clients: list[Any] = field(default_factory=list, repr=False, compare=False)  # made by openai(), closed at the end

    def openai(self, *, loopback: bool = False, **options: Any) -> openai.AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` client on this episode's endpoint, closed when the episode
        ends (no retries by default: the endpoint's error is an answer, not a network blip). Its
        calls go to the endpoint in this process (``http_client``; the agent runs on the run's
        event loop); ``loopback=True``: over the loopback socket, on a connection pool of the run's."""
        import openai

        http = self.loopback_http_client if loopback else self.http_client
        defaults = {"max_retries": 0, **({"http_client": http} if http is not None else {})}
        client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **{**defaults, **options})
        if getattr(client, "_platform", False) is None:
            # the SDK finds its platform headers on a client's first call, in a thread (blocking
            # I/O): a thread hop for every episode's client, ~0.3-0.6 ms of CPU; it is the same answer
            client._platform = _platform()
        self.clients.append(client)
        return client

    def environment(self) -> dict[str, str]:
        """The endpoint as the environment variables the OpenAI SDKs read (for a command)."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key, "OPENAI_MODEL": self.model}


@functools.cache
def _platform() -> Any:
    from openai._base_client import get_platform

    return get_platform()


@dataclass(frozen=True)
class AgentResult:
    """An agent's outcome: its reward (None: let ``grade`` score ``answer``) and figures of its own."""

    reward: float | None = None
    answer: Any = None
    metrics: Metrics = field(default_factory=dict)


Agent = Callable[[AgentEpisode], Any]  # async or plain; returns a reward, an AgentResult, or an answer to grade
Grade = Callable[[Any, Any], Any]  # (problem, answer) -> a number, or an awaitable of one


class AgentEnv(Env):
    """One episode of an agent: driven by the agent's calls (``drive``), not by ``step``."""

    def __init__(self, agent: Agent, problem: Any, endpoint: AgentEndpoint, grade: Grade | None = None):
        self.agent, self.problem, self.endpoint, self.grade = agent, problem, endpoint, grade

    async def drive(self, policy: Policy) -> StepResult:
        async with self.endpoint.episode() as (bridge, base_url):
            where = self.endpoint
            episode = AgentEpisode(
                self.problem, base_url, where.key, where.model, where.max_tokens, where.http_client(),
                where.loopback_client(),
            )  # fmt: skip
            outcome: Any = None
            failure: Exception | None = None
            # the agent runs in this episode's task, its calls are sampled in this task group: what
            # ends the episode (its return, a timeout, its group giving up) ends them too. No call
            # task raises (bridge._serve), so the group never wraps an error.
            try:
                async with asyncio.TaskGroup() as calls:
                    with anyio.CancelScope() as agent_scope:
                        bridge.open(calls, policy, agent_scope)
                        try:
                            outcome = await self._run(episode)
                        except Exception as e:  # an agent's error is its episode's, counted against the budget
                            failure = e
                        finally:
                            bridge.close()
            finally:
                with anyio.CancelScope(shield=True):  # its connections, while the loop that owns them runs
                    for client in episode.clients:
                        await client.close()
        if bridge.error is not None:  # a call failed the episode (the sampler, a prompt too long): its cause
            raise bridge.error
        metrics = bridge.metrics()
        if failure is not None:
            if bridge.over is None or not bridge.calls:
                raise failure
            # refused past its limit, the agent gave up: the episode ends unfinished, with no reward
            return StepResult(0.0, True, metrics={**metrics, "agent/unfinished": 1.0})
        reward, own = await self._reward(outcome)
        return StepResult(reward, True, metrics={**metrics, **own})

    async def _run(self, episode: AgentEpisode) -> Any:
        if inspect.iscoroutinefunction(self.agent) or inspect.iscoroutinefunction(type(self.agent).__call__):
            return await self.agent(episode)
        # a plain function (the sync openai client) blocks: it runs in a thread, and if the
        # episode is cancelled its calls are refused (410) until it returns on its own
        return await anyio.to_thread.run_sync(self.agent, episode, abandon_on_cancel=True)

    async def _reward(self, outcome: Any) -> tuple[float, Metrics]:
        """The agent's reward: the number it returned, or ``grade(problem, answer)``."""
        own: Metrics = {}
        if isinstance(outcome, AgentResult):
            own, outcome = dict(outcome.metrics), outcome.answer if outcome.reward is None else outcome.reward
        if isinstance(outcome, numbers.Real):
            return _finite(float(outcome)), own
        if self.grade is None:
            raise EnvContractError(
                f"the agent returned {outcome!r:.80} ({type(outcome).__name__}); return a reward (a number) or an "
                "AgentResult, or give agent_env a grade(problem, answer) function that scores what it returns"
            )
        score = self.grade(self.problem, outcome)
        if inspect.isawaitable(score):
            score = await score
        if not isinstance(score, numbers.Real):
            raise EnvContractError(f"grade() gave {score!r:.80}; it must return a number (a reward)")
        return _finite(float(score)), own

    async def initial_observation(self) -> tuple[list[int], StopCondition]:
        raise EnvContractError(NOT_STEPPED)

    async def step(self, action: SampledTokens) -> StepResult:
        raise EnvContractError(NOT_STEPPED)


NOT_STEPPED = (
    "an AgentEnv is driven by its agent (drive), never stepped: it has no initial_observation or step "
    "(under --cluster ray a rollout worker drives it, its turns sampled by the driver)"
)


def _finite(reward: float) -> float:
    if not math.isfinite(reward):
        raise EnvContractError(f"the agent's reward is {reward!r}; a reward must be finite")
    return reward


@dataclass(frozen=True)
class AgentGroup(EnvGroupBuilder):
    """G episodes of one problem."""

    agent: Agent
    problem: Any
    endpoint: AgentEndpoint
    group_size: int
    grade: Grade | None = None
    tags: tuple[str, ...] = ("agent",)

    async def make_envs(self) -> Sequence[Env]:
        return [AgentEnv(self.agent, self.problem, self.endpoint, self.grade) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return list(self.tags)


class AgentDataset(RLDataset):
    """Agent groups, ``batch_size`` a batch, each batch rebuilt from its index alone (resume needs
    that); the run enters ``lifespan`` and serves the endpoint for as long as it lives."""

    def __init__(
        self, endpoint: AgentEndpoint, group: Callable[[int, int], EnvGroupBuilder], batch_size: int, batches: int
    ):
        self.endpoint, self.group, self.batch_size, self.batches = endpoint, group, batch_size, batches

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        return [self.group(index, j) for j in range(self.batch_size)]

    def __len__(self) -> int:
        return self.batches

    def lifespan(self) -> AbstractAsyncContextManager[None]:
        return self.endpoint.lifespan()


def agent_env(
    ctx: EnvContext,
    agent: Agent,
    problems: Sequence[Any] | Callable[[random.Random], Any],
    *,
    grade: Grade | None = None,
    tags: Sequence[str] = ("agent",),
) -> AgentDataset:
    """A dataset of ``agent`` episodes, ``ctx.group_size`` per problem, a batch per step.
    ``problems``: a list (group j of batch i gets item ``(i * batch_size + j) % len``, so an
    evaluation of N problems sees the first N once) or a function drawing one from a
    ``random.Random`` seeded by (seed, batch, group). The endpoint speaks for the run's model
    with its renderer (``ctx.renderer``), at most ``ctx.max_tokens`` tokens a call."""
    endpoint = AgentEndpoint(ctx.renderer, ctx.tokenizer, ctx.max_tokens, ctx.model)
    if callable(problems):
        draw = problems

        def problem(i: int, j: int) -> Any:
            return draw(random.Random(f"{ctx.seed}/{i}/{j}"))
    else:
        items = list(problems)
        if not items:
            raise ValueError("agent_env needs at least one problem")

        def problem(i: int, j: int) -> Any:
            return items[(i * ctx.batch_size + j) % len(items)]

    def group(i: int, j: int) -> AgentGroup:
        return AgentGroup(agent, problem(i, j), endpoint, ctx.group_size, grade, tuple(tags))

    return AgentDataset(endpoint, group, ctx.batch_size, max(ctx.steps, 1))

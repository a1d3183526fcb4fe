"""RolloutActor: N workers, each running one group at a time against a shared retry budget.

A member whose episode raises or times out is retried with a fresh env while the group's budget
lasts; ``make_envs`` failing, hanging or short of envs counts the same. When the budget is spent,
the group's other members are cancelled and the whole group is dropped and counted: a partial
group biases the advantages (unless configured otherwise). Cancellation from outside is never
caught here: it passes through every ``except Exception``, and a ``CancelledError`` that env code
raises on its own is told apart from it (``own_cancellation``) and counted as that env's error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field

import anyio

from headrace.core import logs
from headrace.core.advantages import check_step_rewards, checked_totals
from headrace.core.channel import Channel
from headrace.core.episode import (
    EnvContractError,
    EpisodeSpec,
    PromptTooLongError,
    check_metrics,
    check_observation,
    check_reward,
    is_self_driven,
    params_for,
    run_episode,
)
from headrace.core.sampler import SamplerActor
from headrace.core.trace import RolloutFinished, RolloutStarted, Tracer, current_rollout
from headrace.core.types import (
    DroppedGroup,
    Env,
    EnvGroupBuilder,
    GroupKey,
    SampledTokens,
    SamplingParams,
    StopCondition,
    Tokens,
    Trajectory,
    TrajectoryGroup,
)

# errors that say the run itself is wrong: retrying them only burns the budget
FATAL = (EnvContractError, PromptTooLongError)
CLEANUP_TIMEOUT_S = 30.0

log = logs.get_logger()


@dataclass(frozen=True)
class RolloutItem:
    key: GroupKey
    builder: EnvGroupBuilder
    batch_size: int  # groups in this item's batch, so the learner knows when the batch is whole


@dataclass(frozen=True)
class RolloutResult:
    item: RolloutItem
    group: TrajectoryGroup | DroppedGroup
    seconds: float


@dataclass
class _Budget:
    left: int
    spent: bool = False
    errors: list[str] = field(default_factory=list)


@dataclass
class _Members:
    """The member tasks of one group, so a member that spends the budget can stop the others."""

    tasks: list[asyncio.Task] = field(default_factory=list)

    def cancel_others(self) -> None:
        # on the next loop iteration, as anyio's cancel scopes do: members not started yet start,
        # reach their first await and are cancelled there, so every env sees its cancellation
        me = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for task in self.tasks:
            if task is not me:
                loop.call_soon(task.cancel)


@dataclass(frozen=True)
class RetrySettings:
    budget: int
    timeout_s: float | None
    partial_groups: bool
    max_consecutive_dropped: int = 20


@dataclass
class SampleCalls:
    """The sample calls of one attempt, remembering what they raised: that error is the backend's,
    so it passes through the handlers that spend the retry budget on env errors and stops the run.
    (A prompt too long for the context is the env's, and fatal anyway; a timeout is the rollout's.)"""

    sampler: SamplerActor
    failed: BaseException | None = None

    async def sample(self, prompt: Tokens, n: int, params: SamplingParams) -> list[SampledTokens]:
        try:
            return await self.sampler.sample(prompt, n, params)
        except PromptTooLongError:
            raise
        except Exception as e:
            self.failed = e
            raise

    def raised(self, error: BaseException) -> bool:
        return error is self.failed


class TooManyDroppedGroups(RuntimeError):
    """The run keeps losing whole groups: something is broken, stop instead of spinning."""


@dataclass
class DroppedGroupBreaker:
    """Stops the run after ``limit`` groups in a row spent their retry budget (counted in the
    order groups finish): one bad group is the budget's job, a run of them is a broken env or backend."""

    limit: int
    in_a_row: int = 0

    def record(self, group: TrajectoryGroup | DroppedGroup) -> None:
        if not isinstance(group, DroppedGroup):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise TooManyDroppedGroups(
                f"{self.in_a_row} groups in a row were dropped after spending their retry budget "
                f"(last errors: {'; '.join(group.errors[-3:])}). Fix the env or the backend, or raise "
                "retry.budget / retry.max_consecutive_dropped."
            )


class RolloutActor:
    def __init__(
        self,
        inbox: Channel[RolloutItem],
        outbox: Channel[RolloutResult],
        sampler: SamplerActor,
        spec: EpisodeSpec,
        retry: RetrySettings,
        workers: int,
        tracer: Tracer | None = None,
    ):
        self.inbox, self.outbox, self._tracer = inbox, outbox, tracer
        self.sampler, self.spec, self.retry, self.workers = sampler, spec, retry, workers
        self.error_counts: Counter[str] = Counter()
        self.breaker = DroppedGroupBreaker(retry.max_consecutive_dropped)
        self._running: dict[GroupKey, anyio.CancelScope] = {}
        self.regenerated = 0

    def regenerate(self, key: GroupKey) -> bool:
        """Throw away a running group's work and start it again from its prompt, with the weights
        current then (the inflight gate, for a group about to exceed the staleness bound). False
        when the group is not running (it just finished)."""
        scope = self._running.get(key)
        if scope is None or scope.cancel_called:
            return False
        scope.cancel()
        return True

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(self.workers):
                tg.start_soon(self._worker)
        self.outbox.close()  # only on success: after an error the task group cancels everyone

    async def _worker(self) -> None:
        async for item in self.inbox:
            start = time.perf_counter()
            rollout = (item.key.batch, item.key.index, -1)
            current_rollout.set(rollout)  # for the sample calls' trace events
            if self._tracer is not None:
                self._tracer(RolloutStarted(rollout, start))
            while True:
                with anyio.CancelScope() as scope:
                    self._running[item.key] = scope
                    group = await self.rollout_group(item)
                self._running.pop(item.key, None)
                if not scope.cancel_called:  # called: the result (if any) is of the old weights
                    break
                self.regenerated += 1
            if self._tracer is not None:
                self._tracer(RolloutFinished(rollout, isinstance(group, DroppedGroup), time.perf_counter()))
            self.breaker.record(group)
            await self.outbox.put(RolloutResult(item, group, time.perf_counter() - start))
            del group  # a worker waiting for its next item holds no trajectories

    async def rollout_group(self, item: RolloutItem) -> TrajectoryGroup | DroppedGroup:
        builder, key = item.builder, item.key
        try:
            return await self._rollout(builder, key)
        finally:
            # (the base class's cleanup does nothing: skip the two cancel scopes, once per group)
            if type(builder).cleanup is not EnvGroupBuilder.cleanup:
                await self._cleanup(builder, key)

    async def _rollout(self, builder: EnvGroupBuilder, key: GroupKey) -> TrajectoryGroup | DroppedGroup:
        budget = _Budget(self.retry.budget)
        envs = await self._first_envs(builder, key, budget)
        if envs is None:
            return self._dropped(key, budget)
        size = len(envs)
        results: list[Trajectory | None] = [None] * size
        # a self-driven env (an agent) asks for its own turns: it has no first prompt to share
        firsts = [None] * size if is_self_driven(envs[0]) else await self._shared_first_actions(envs, key, budget)
        # asyncio's TaskGroup, not anyio's: this starts a task per trajectory, and anyio's
        # start_soon costs about 4x more per task (benchmarks/RESULTS.md, "Measured design choices")
        members = _Members()
        async with asyncio.TaskGroup() as tg:
            for i in range(size):
                members.tasks.append(
                    tg.create_task(self._member(builder, envs[i], i, key, firsts[i], results, budget, members))
                )
        done = [t for t in results if t is not None]
        if budget.spent and not (self.retry.partial_groups and done):
            return self._dropped(key, budget)
        try:
            with own_cancellation(f"{type(builder).__name__}.compute_group_rewards()"):
                rewards = check_group_rewards(builder, await builder.compute_group_rewards(done), len(done))
        except FATAL:
            raise
        except Exception as e:  # a judge that fails loses its group, like any env error
            self._count(e, budget, key)
            return self._dropped(key, budget)
        totals = checked_totals(builder, done, rewards)  # NaN, inf, beyond float32: a contract error
        return TrajectoryGroup(key, done, totals, group_metrics(done, rewards), builder.logging_tags())

    async def _first_envs(self, builder: EnvGroupBuilder, key: GroupKey, budget: _Budget) -> list[Env] | None:
        """The group's envs; a ``make_envs`` that fails or hangs is retried against the budget
        (a sandbox that can't start loses its group, not the run). None once the budget is spent."""
        while True:
            try:
                with self._timeout(), own_cancellation(f"{type(builder).__name__}.make_envs()"):
                    envs = check_envs(builder, await builder.make_envs())
                if not envs:
                    raise EnvContractError(
                        f"{type(builder).__name__}.make_envs() returned no envs; a group needs at least one"
                    )
                return envs
            except FATAL:
                raise
            except Exception as e:
                if not self._spend(e, budget, key):
                    return None

    async def _fresh_env(self, builder: EnvGroupBuilder, i: int, size: int) -> Env:
        envs = check_envs(builder, await builder.make_envs())
        if len(envs) != size:
            raise WrongEnvCount(
                f"{type(builder).__name__}.make_envs() returned {len(envs)} envs on a retry, the group has {size}"
            )
        return envs[i]

    async def _shared_first_actions(self, envs, key: GroupKey, budget: _Budget) -> list:
        """One ``n=G`` sample when every member starts from the same prompt (remote samplers
        batch it, and the group shares the prompt's prefill). Each env is asked for its prompt
        once: members whose prompts differ, or whose shared sample failed, start from their own
        prompt; a member whose prompt could not be had falls back to its own path, which applies
        the retry budget."""
        vocab = self.spec.vocab_size
        observations: list[tuple[Tokens, StopCondition]] = []
        calls = SampleCalls(self.sampler)
        try:
            with self._timeout(), own_cancellation(f"{type(envs[0]).__name__}.initial_observation()"):
                observations.append(check_observation(envs[0], await envs[0].initial_observation(), vocab))
                for env in envs[1:]:  # a prompt equal to a checked one is sound: compared at C speed
                    o = await env.initial_observation()
                    observations.append(o if o == observations[0] else check_observation(env, o, vocab))
            if any(o != observations[0] for o in observations[1:]):
                return [(prompt, stop, None) for prompt, stop in observations]
            prompt, stop = observations[0]
            seed = self.spec.seed ^ hash((key.batch, key.index)) & 0x7FFFFFFF
            with self._timeout(), own_cancellation("the group's first sample"):
                actions = await calls.sample(prompt, len(envs), params_for(self.spec, stop, seed))
        except FATAL:
            raise
        except Exception as e:
            if calls.raised(e):
                raise
            self._count(e, budget, key)
            own = [(prompt, stop, None) for prompt, stop in observations]
            return own + [None] * (len(envs) - len(own))
        return [(prompt, stop, a) for a in actions]

    async def _member(
        self, builder, env, i: int, key: GroupKey, first, results, budget: _Budget, members: _Members
    ) -> None:
        attempt, size = 0, len(results)
        current_rollout.set((key.batch, key.index, i))
        while True:
            seed = (self.spec.seed * 1_000_003 + key.batch * 10_007 + key.index * 101 + i * 7 + attempt) & 0x7FFFFFFF
            calls = SampleCalls(self.sampler)
            try:
                # one attempt (a retry's fresh env included) runs under the rollout timeout
                with self._timeout(), own_cancellation(f"the rollout of {type(builder).__name__} member {i}"):
                    if env is None:
                        env = await self._fresh_env(builder, i, size)
                    trajectory = await run_episode(env, calls.sample, self.spec, seed, first)
                    results[i] = check_step_rewards(env, trajectory)  # NaN, inf: a contract error
                return
            except FATAL:
                raise
            except Exception as e:
                if calls.raised(e):
                    raise  # the backend failed, not the env: no budget pays for that
                if not self._spend(e, budget, key):
                    members.cancel_others()  # the group is lost: stop its other members now
                    return
                attempt, first, env = attempt + 1, None, None

    async def _cleanup(self, builder: EnvGroupBuilder, key: GroupKey) -> None:
        """Runs even when the run is being cancelled; bounded so it can't hang. A cleanup that
        fails is logged and counted, never fatal: the group's data is sound either way, and one
        leaked sandbox is not worth the rest of a long run (the count makes a pattern visible)."""
        with anyio.CancelScope(shield=True):
            try:
                with anyio.fail_after(CLEANUP_TIMEOUT_S), own_cancellation(f"{type(builder).__name__}.cleanup()"):
                    await builder.cleanup()
            except Exception as e:
                name = f"cleanup/{type(e).__name__}"
                self.error_counts[name] += 1
                log.warning("cleanup_failed", batch=key.batch, index=key.index, error=name, detail=str(e)[:200])

    def _timeout(self):
        t = self.retry.timeout_s
        return anyio.fail_after(t) if t else _NO_TIMEOUT

    def _spend(self, error: Exception, budget: _Budget, key: GroupKey) -> bool:
        """Count a failed attempt; True while the budget pays for another one."""
        self._count(error, budget, key)
        if budget.left <= 0:
            budget.spent = True
            return False
        budget.left -= 1
        return True

    def _dropped(self, key: GroupKey, budget: _Budget) -> DroppedGroup:
        log.warning("group_dropped", batch=key.batch, index=key.index, errors=budget.errors[-3:])
        return DroppedGroup(key, budget.errors)

    def _count(self, error: Exception, budget: _Budget, key: GroupKey) -> None:
        name = type(error).__name__
        self.error_counts[name] += 1
        budget.errors.append(f"{name}: {error}")
        log.info("rollout_error", batch=key.batch, index=key.index, error=name, detail=str(error)[:200])


_NO_TIMEOUT = contextlib.nullcontext()  # reusable: it holds no state


class WrongEnvCount(RuntimeError):
    """A retry's ``make_envs`` returned a different number of envs than the group has."""


class EnvCancelledError(RuntimeError):
    """Env code raised ``CancelledError`` although nothing cancelled its rollout."""


class own_cancellation:  # noqa: N801 - used as a function; a class, not @contextmanager: ~5x cheaper per use
    """Tells an env's own ``CancelledError`` (a cancelled task it awaited, a bug) from a real
    cancellation of this task: the first becomes an error of that env, the second (shutdown, a
    timeout, a group that gave up) always passes through. A task being cancelled has a nonzero
    ``cancelling()`` count; asyncio and anyio both cancel through ``Task.cancel``."""

    __slots__ = ("what",)

    def __init__(self, what: str):
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> None:
        if kind is None or not issubclass(kind, asyncio.CancelledError):
            return
        task = asyncio.current_task()
        if task is None or task.cancelling():
            return
        raise EnvCancelledError(f"{self.what} raised CancelledError although nothing cancelled it") from e


def check_envs(builder: EnvGroupBuilder, envs: object) -> list[Env]:
    if not isinstance(envs, list | tuple) or not all(isinstance(e, Env) for e in envs):
        raise EnvContractError(
            f"{type(builder).__name__}.make_envs() returned {envs!r:.80}; it must return a list of headrace.Env"
        )
    return list(envs)


def check_group_rewards(builder: EnvGroupBuilder, rewards: object, n: int) -> list[tuple[float, dict]]:
    what = f"{type(builder).__name__}.compute_group_rewards()"
    if not isinstance(rewards, list | tuple) or len(rewards) != n:
        got = f"{len(rewards)} rewards" if isinstance(rewards, list | tuple) else type(rewards).__name__
        raise EnvContractError(f"{what} returned {got} for {n} trajectories; it must return one (reward, metrics) each")
    if not all(isinstance(pair, tuple) and len(pair) == 2 for pair in rewards):
        raise EnvContractError(f"{what} returned {rewards!r:.80}; each item must be a (reward, metrics) tuple")
    method = "compute_group_rewards()"
    return [(check_reward(builder, method, r), check_metrics(builder, method, m)) for r, m in rewards]


def group_metrics(trajectories: list[Trajectory], rewards: list[tuple[float, dict]]) -> dict[str, float]:
    """The group's figures: each ``StepResult.metrics`` name averaged over the group's steps, then
    the group-level metrics of ``compute_group_rewards`` averaged over members (they win a clash)."""
    steps: dict[str, list[float]] = {}
    for t in trajectories:
        for transition in t.transitions:
            for name, value in transition.metrics.items():
                steps.setdefault(name, []).append(value)
    metrics = {name: sum(values) / len(values) for name, values in steps.items()}
    grouped: dict[str, float] = {}
    for _, m in rewards:
        for name, value in m.items():
            grouped[name] = grouped.get(name, 0.0) + value / len(rewards)
    return metrics | grouped

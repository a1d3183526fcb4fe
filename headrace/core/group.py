"""One group's lifecycle, the same for the rollout actor and the evaluator: ``make_envs`` →
episodes → group rewards → contract checks → cleanup (``GroupRunner.run``). What the two choose
differently is a ``GroupPolicy``: the retry budget, a timeout, whether the group's first actions
are one ``n=G`` sample, a greedy first member, whether its sample calls are traced.

A member whose episode raises or times out is retried with a fresh env while the group's budget
lasts; ``make_envs`` failing, hanging or short of envs counts the same. When the budget is spent,
the group's other members are cancelled and the whole group is dropped (``DroppedGroup``): a
partial group biases the advantages (unless the policy keeps them). A broken contract
(``EnvContractError``) or a prompt too long for the context (``FATAL``) is raised, never
retried, and so is what a sample call raised: the backend's failure, not the env's
(``SampleCalls``). Cancellation from outside is never caught here: it passes through every
``except Exception``, and a ``CancelledError`` that env code raises on its own is told apart from
it (``own_cancellation``) and counted as that env's error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio

from headrace.core import logs
from headrace.core.advantages import check_step_rewards, checked_totals
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
from headrace.core.errors import EnvError, root_cause
from headrace.core.trace import current_rollout
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

Sample = Callable[[Tokens, int, SamplingParams], Awaitable[list[SampledTokens]]]

log = logs.get_logger()


def rollout_seed(seed: int, key: GroupKey, member: int, attempt: int) -> int:
    """A member's sampling seed from (run seed, batch, group, member, retry): never from timing."""
    return (seed * 1_000_003 + key.batch * 10_007 + key.index * 101 + member * 7 + attempt) & 0x7FFFFFFF


@dataclass(frozen=True)
class GroupPolicy:
    """How a group is run, where rollouts and eval differ (``ROLLOUT`` fields by default)."""

    budget: int = 0  # retries shared by the group's members (make_envs included)
    timeout_s: float | None = None  # per attempt
    partial_groups: bool = False  # keep the members that finished when the budget runs out
    share_first_sample: bool = True  # one n=G sample when every member starts from the same prompt
    greedy_first: bool = False  # member 0 samples at temperature 0 (eval.greedy)
    traced: bool = True  # sample calls carry the rollout they serve (core/trace.py)
    seed: Callable[[int, GroupKey, int, int], int] = rollout_seed  # (run seed, key, member, attempt)


class SampleCalls:
    """The sample calls of one attempt, remembering what they raised: that error is the backend's,
    so it passes through the handlers that spend the retry budget on env errors and stops the run.
    (A prompt too long for the context is the env's, and fatal anyway; a timeout is the rollout's.)
    A slotted class: one is made for every trajectory."""

    __slots__ = ("failed", "sampler")

    def __init__(self, sampler: Sample):
        self.sampler = sampler
        self.failed: BaseException | None = None

    async def sample(self, prompt: Tokens, n: int, params: SamplingParams) -> list[SampledTokens]:
        try:
            return await self.sampler(prompt, n, params)
        except PromptTooLongError:
            raise
        except Exception as e:
            self.failed = e
            raise

    def raised(self, error: BaseException) -> bool:
        return error is self.failed


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


class WrongEnvCount(EnvError, RuntimeError):
    """A retry's ``make_envs`` returned a different number of envs than the group has."""


class EnvCancelledError(EnvError, RuntimeError):
    """Env code raised ``CancelledError`` although nothing cancelled its rollout."""


class GroupRunner:
    """Runs groups under one policy: ``sample`` serves their calls (the run's sampler, or one
    pinned to a version), ``error_counts`` counts what failed by name (``cleanup/<name>`` for a
    cleanup), ``limiter`` bounds the episodes running at once (eval.max_concurrency)."""

    def __init__(
        self,
        sample: Sample,
        spec: EpisodeSpec,
        policy: GroupPolicy,
        error_counts: Counter[str] | None = None,
        limiter: anyio.CapacityLimiter | None = None,
    ):
        self.sample, self.spec, self.policy, self.limiter = sample, spec, policy, limiter
        self.error_counts: Counter[str] = Counter() if error_counts is None else error_counts
        self._greedy = dataclasses.replace(spec, base_params=dataclasses.replace(spec.base_params, temperature=0.0))

    async def run(self, builder: EnvGroupBuilder, key: GroupKey) -> TrajectoryGroup | DroppedGroup:
        """The group, its rewards computed and checked; its cleanup always runs (bounded). What
        stops the run (a broken contract, the backend's failure) is raised as itself, not as the
        group of the member tasks it came from, so each caller's policy can tell what it is."""
        try:
            return await self._rollout(builder, key)
        except BaseExceptionGroup as group:
            raise root_cause(group) from None
        finally:
            # (the base class's cleanup does nothing: skip the two cancel scopes, once per group)
            if type(builder).cleanup is not EnvGroupBuilder.cleanup:
                await self._cleanup(builder, key)

    async def _rollout(self, builder: EnvGroupBuilder, key: GroupKey) -> TrajectoryGroup | DroppedGroup:
        budget = _Budget(self.policy.budget)
        envs = await self._first_envs(builder, key, budget)
        if envs is None:
            return self._dropped(key, budget)
        size = len(envs)
        results: list[Trajectory | None] = [None] * size
        # a self-driven env (an agent) asks for its own turns: it has no first prompt to share;
        # a greedy first member samples with other parameters than the rest
        share = self.policy.share_first_sample and not self.policy.greedy_first and not is_self_driven(envs[0])
        firsts = await self._shared_first_actions(envs, key, budget) if share else [None] * size
        # asyncio's TaskGroup, not anyio's: this starts a task per trajectory, and anyio's
        # start_soon costs about 4x more per task (benchmarks/RESULTS.md, "Measured design choices")
        members = _Members()
        async with asyncio.TaskGroup() as tg:
            for i in range(size):
                members.tasks.append(
                    tg.create_task(self._member(builder, envs[i], i, key, firsts[i], results, budget, members))
                )
        done = [t for t in results if t is not None]
        if budget.spent and not (self.policy.partial_groups and done):
            return self._dropped(key, budget)
        try:
            with own_cancellation("{}.compute_group_rewards()", builder):
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
                with self._timeout(), own_cancellation("{}.make_envs()", builder):
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
        calls = SampleCalls(self.sample)
        try:
            same = True
            with self._timeout(), own_cancellation("{}.initial_observation()", envs[0]):
                first = check_observation(envs[0], await envs[0].initial_observation(), vocab)
                observations.append(first)
                for env in envs[1:]:  # a prompt equal to a checked one is sound: compared at C speed
                    o = await env.initial_observation()
                    if o != first:
                        same, o = False, check_observation(env, o, vocab)
                    observations.append(o)
            if not same:
                return [(prompt, stop, None) for prompt, stop in observations]
            prompt, stop = first
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
        if self.policy.traced:
            current_rollout.set((key.batch, key.index, i))
        spec = self._greedy if i == 0 and self.policy.greedy_first else self.spec
        while True:
            seed = self.policy.seed(self.spec.seed, key, i, attempt)
            calls = SampleCalls(self.sample)
            try:
                # one attempt (a retry's fresh env included) runs under the rollout timeout
                with self._timeout(), own_cancellation("the rollout of {} member {}", builder, i):
                    if env is None:
                        env = await self._fresh_env(builder, i, size)
                    if self.limiter is None:
                        trajectory = await run_episode(env, calls.sample, spec, seed, first)
                    else:
                        async with self.limiter:
                            trajectory = await run_episode(env, calls.sample, spec, seed, first)
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
                with anyio.fail_after(CLEANUP_TIMEOUT_S), own_cancellation("{}.cleanup()", builder):
                    await builder.cleanup()
            except Exception as e:
                name = f"cleanup/{type(e).__name__}"
                self.error_counts[name] += 1
                log.warning("cleanup_failed", batch=key.batch, index=key.index, error=name, detail=str(e)[:200])

    def _timeout(self):
        t = self.policy.timeout_s
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


class own_cancellation:  # noqa: N801 - used as a function; a class, not @contextmanager: ~5x cheaper per use
    """Tells an env's own ``CancelledError`` (a cancelled task it awaited, a bug) from a real
    cancellation of this task: the first becomes an error of that env, the second (shutdown, a
    timeout, a group that gave up) always passes through. A task being cancelled has a nonzero
    ``cancelling()`` count; asyncio and anyio both cancel through ``Task.cancel``."""

    __slots__ = ("what", "owners")

    def __init__(self, what: str, *owners: object):
        # ``what`` names the code, with a ``{}`` for each owner's type name (or its value, for an
        # int): formatted only if it raised, since this is entered for every trajectory
        self.what, self.owners = what, owners

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> None:
        if kind is None or not issubclass(kind, asyncio.CancelledError):
            return
        task = asyncio.current_task()
        if task is None or task.cancelling():
            return
        what = self.what.format(*(o if type(o) is int else type(o).__name__ for o in self.owners))
        raise EnvCancelledError(f"{what} raised CancelledError although nothing cancelled it") from e


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
    per_step = [transition.metrics for t in trajectories for transition in t.transitions]
    names = per_step[0].keys() if per_step else {}.keys()
    if all(m.keys() == names for m in per_step):  # every step reports the same names: the usual case
        n = len(per_step)
        metrics = {name: sum([m[name] for m in per_step]) / n for name in names}  # the same sums, in order
    else:
        steps: dict[str, list[float]] = {}
        for m in per_step:
            for name, value in m.items():
                steps.setdefault(name, []).append(value)
        metrics = {name: sum(values) / len(values) for name, values in steps.items()}
    grouped: dict[str, float] = {}
    for _, m in rewards:
        for name, value in m.items():
            grouped[name] = grouped.get(name, 0.0) + value / len(rewards)
    return metrics | grouped

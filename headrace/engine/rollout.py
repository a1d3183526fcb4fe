"""RolloutActor: N workers, each running one group at a time against a shared retry budget.

A member whose episode raises or times out is retried with a fresh env while the group's budget
lasts. When the budget is spent, the group's other members are cancelled and the whole group is
dropped and counted: a partial group biases the advantages (unless configured otherwise).
Cancellation from outside is never caught here; it passes through every ``except Exception``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from contextvars import ContextVar
from dataclasses import dataclass, field

import anyio
import structlog

from headrace.engine.channel import Channel
from headrace.engine.episode import (
    EnvContractError,
    EpisodeSpec,
    PromptTooLongError,
    check_observation,
    params_for,
    run_episode,
)

# errors that say the run itself is wrong: retrying them only burns the budget
FATAL = (EnvContractError, PromptTooLongError)
from headrace.engine.sampler import SamplerActor
from headrace.engine.types import DroppedGroup, EnvGroupBuilder, GroupKey, Trajectory, TrajectoryGroup

log = structlog.get_logger("headrace.rollout")

# (batch, group index, member) of the rollout running in this task; member -1 while the group
# shares its first sample. Read by backends that record their work per rollout (the sim, for
# the benchmarks' ideal bounds); set per task, so it costs nothing on the hot path.
current_rollout: ContextVar[tuple[int, int, int] | None] = ContextVar("current_rollout", default=None)


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
class RetryPolicy:
    budget: int
    timeout_s: float | None
    partial_groups: bool


class RolloutActor:
    def __init__(
        self,
        inbox: Channel[RolloutItem],
        outbox: Channel[RolloutResult],
        sampler: SamplerActor,
        spec: EpisodeSpec,
        retry: RetryPolicy,
        workers: int,
    ):
        self.inbox, self.outbox = inbox, outbox
        self.sampler, self.spec, self.retry, self.workers = sampler, spec, retry, workers
        self.error_counts: Counter[str] = Counter()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(self.workers):
                tg.start_soon(self._worker)
        self.outbox.close()  # only on success: after an error the task group cancels everyone

    async def _worker(self) -> None:
        async for item in self.inbox:
            start = time.perf_counter()
            current_rollout.set((item.key.batch, item.key.index, -1))
            group = await self.rollout_group(item)
            await self.outbox.put(RolloutResult(item, group, time.perf_counter() - start))

    async def rollout_group(self, item: RolloutItem) -> TrajectoryGroup | DroppedGroup:
        builder, key = item.builder, item.key
        try:
            return await self._rollout(builder, key)
        finally:
            # cleanup always runs, even when the run is being cancelled; bounded so it can't hang.
            # (The base class's cleanup does nothing: skip the two cancel scopes, once per group.)
            if type(builder).cleanup is not EnvGroupBuilder.cleanup:
                with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                    await builder.cleanup()

    async def _rollout(self, builder: EnvGroupBuilder, key: GroupKey) -> TrajectoryGroup | DroppedGroup:
        budget = _Budget(self.retry.budget)
        try:
            envs = list(await builder.make_envs())
        except Exception as e:  # a sandbox that can't start loses its group, not the run
            self._count(e, budget, key)
            return DroppedGroup(key, budget.errors)
        size = len(envs)
        if size == 0:
            raise EnvContractError(f"{type(builder).__name__}.make_envs() returned no envs")
        results: list[Trajectory | None] = [None] * size
        firsts = await self._shared_first_actions(envs, key, budget)
        # asyncio's TaskGroup, not anyio's: this starts a task per trajectory, and anyio's
        # start_soon costs ~4x more (31 vs 8 us per task on this machine); see benchmarks/RESULTS.md
        members = _Members()
        async with asyncio.TaskGroup() as tg:
            for i in range(size):
                members.tasks.append(tg.create_task(self._member(builder, envs[i], i, key, firsts[i], results, budget, members)))
        done = [t for t in results if t is not None]
        if budget.spent and not (self.retry.partial_groups and done):
            log.warning("group_dropped", batch=key.batch, index=key.index, errors=budget.errors[-3:])
            return DroppedGroup(key, budget.errors)
        rewards = await builder.compute_group_rewards(done)
        if len(rewards) != len(done):
            raise EnvContractError(
                f"{type(builder).__name__}.compute_group_rewards returned {len(rewards)} rewards for {len(done)} trajectories"
            )
        totals = [t.total_reward + r for t, (r, _) in zip(done, rewards, strict=True)]
        metrics: dict[str, float] = {}
        for _, m in rewards:
            for name, value in m.items():
                metrics[name] = metrics.get(name, 0.0) + value / len(rewards)
        return TrajectoryGroup(key, done, totals, metrics, builder.logging_tags())

    async def _shared_first_actions(self, envs, key: GroupKey, budget: _Budget) -> list:
        """One ``n=G`` sample when every member starts from the same prompt (remote samplers
        batch it, and the group shares the prompt's prefill). Members whose start fails here
        fall back to their own path, which applies the retry budget."""
        try:
            with self._timeout():
                observations = [check_observation(env, await env.initial_observation()) for env in envs]
            if any(o != observations[0] for o in observations[1:]):
                return [None] * len(envs)
            prompt, stop = observations[0]
            seed = self.spec.seed ^ hash((key.batch, key.index)) & 0x7FFFFFFF
            with self._timeout():
                actions = await self.sampler.sample(prompt, len(envs), params_for(self.spec, stop, seed))
        except FATAL:
            raise
        except Exception as e:
            self._count(e, budget, key)
            return [None] * len(envs)
        return [(prompt, stop, a) for a in actions]

    async def _member(self, builder, env, i: int, key: GroupKey, first, results, budget: _Budget, members: _Members) -> None:
        attempt = 0
        current_rollout.set((key.batch, key.index, i))
        while True:
            seed = (self.spec.seed * 1_000_003 + key.batch * 10_007 + key.index * 101 + i * 7 + attempt) & 0x7FFFFFFF
            try:
                with self._timeout():
                    results[i] = await run_episode(env, self.sampler.sample, self.spec, seed, first)
                return
            except FATAL:
                raise
            except Exception as e:
                self._count(e, budget, key)
                if budget.left <= 0:
                    budget.spent = True
                    members.cancel_others()  # the group is lost: stop its other members now
                    return
                budget.left -= 1
                attempt, first = attempt + 1, None
                env = (await builder.make_envs())[i]

    def _timeout(self):
        t = self.retry.timeout_s
        return anyio.fail_after(t) if t else contextlib.nullcontext()

    def _count(self, error: Exception, budget: _Budget, key: GroupKey) -> None:
        name = type(error).__name__
        self.error_counts[name] += 1
        budget.errors.append(f"{name}: {error}")
        log.info("rollout_error", batch=key.batch, index=key.index, error=name, detail=str(error)[:200])

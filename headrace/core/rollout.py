"""RolloutActor: N workers, each running one group at a time against a shared retry budget.

A group runs through ``core/group.py``'s lifecycle (``GroupRunner``: make_envs → episodes → group
rewards → contract checks → cleanup), the evaluator's too; this actor gives it the run's retry
policy (``RetrySettings``), the sampler, and the breaker that stops a run whose groups keep being
dropped.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import anyio

from headrace.core.channel import Channel
from headrace.core.episode import EpisodeSpec
from headrace.core.errors import RunError
from headrace.core.frozen import quick_init
from headrace.core.group import (  # noqa: F401 - re-exported: they lived here before core/group.py
    CLEANUP_TIMEOUT_S,
    FATAL,
    EnvCancelledError,
    GroupPolicy,
    GroupRunner,
    SampleCalls,
    WrongEnvCount,
    check_envs,
    check_group_rewards,
    group_metrics,
    own_cancellation,
)
from headrace.core.sampler import SamplerActor
from headrace.core.trace import RolloutFinished, RolloutStarted, Tracer, current_rollout
from headrace.core.types import DroppedGroup, EnvGroupBuilder, GroupKey, TrajectoryGroup


@quick_init
@dataclass(frozen=True)
class RolloutItem:
    key: GroupKey
    builder: EnvGroupBuilder
    batch_size: int  # groups in this item's batch, so the learner knows when the batch is whole


@quick_init
@dataclass(frozen=True)
class RolloutResult:
    item: RolloutItem
    group: TrajectoryGroup | DroppedGroup
    seconds: float


@dataclass(frozen=True)
class RetrySettings:
    budget: int
    timeout_s: float | None
    partial_groups: bool
    max_consecutive_dropped: int = 20


class TooManyDroppedGroups(RunError, RuntimeError):
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
        # the run's retry policy over the one group lifecycle (the evaluator runs it with its own)
        self._groups = GroupRunner(
            sampler.sample, spec, GroupPolicy(retry.budget, retry.timeout_s, retry.partial_groups), self.error_counts
        )
        self.breaker = DroppedGroupBreaker(retry.max_consecutive_dropped)
        self._running: dict[GroupKey, anyio.CancelScope] = {}

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
            if self._tracer is not None:
                self._tracer(RolloutFinished(rollout, isinstance(group, DroppedGroup), time.perf_counter()))
            self.breaker.record(group)
            await self.outbox.put(RolloutResult(item, group, time.perf_counter() - start))
            del group  # a worker waiting for its next item holds no trajectories

    async def rollout_group(self, item: RolloutItem) -> TrajectoryGroup | DroppedGroup:
        return await self._groups.run(item.builder, item.key)

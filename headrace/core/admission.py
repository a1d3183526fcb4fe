"""AdmissionGate: feeds batches to the rollout workers, each only when the scheduler allows it.

Batch k is admitted once the sampler holds weights of version ≥ k − lag: lag 0 is on-policy
(sync, stream); lag m bounds staleness by admission (async) instead of discarding finished work.
``InflightGate`` admits group by group instead, and gives finished groups their steps.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable
from typing import Any

import anyio

from headrace.core.advantage_actor import ProcessedGroup
from headrace.core.channel import Channel
from headrace.core.episode import EnvContractError
from headrace.core.errors import ConfigError
from headrace.core.rollout import RolloutItem
from headrace.core.sampler import SamplerActor
from headrace.core.types import GroupKey, RLDataset


def check_dataset(dataset: Any, source: str) -> RLDataset:
    """Refuse a dataset the gate could never draw a batch from, before the run starts."""
    if dataset is None or not callable(getattr(dataset, "get_batch", None)) or not hasattr(dataset, "__len__"):
        raise ConfigError(
            f"{source} gave {type(dataset).__name__} as its dataset; an env factory must return a headrace.RLDataset "
            "(e.g. a ProblemDataset), with get_batch(index) and __len__"
        )
    if len(dataset) <= 0:
        raise ConfigError(
            f"{source} gave an empty dataset ({type(dataset).__name__} has no batches); give it one or more"
        )
    return dataset


class AdmissionGate:
    def __init__(self, dataset: RLDataset, outbox: Channel[RolloutItem], sampler: SamplerActor, steps: range, lag: int):
        self.dataset = check_dataset(dataset, "train(dataset=...)")
        self.outbox, self.sampler, self.steps, self.lag = outbox, sampler, steps, lag

    async def run(self) -> None:
        for batch in self.steps:
            await self.sampler.wait_for_version(batch - self.lag)
            builders = self.dataset.get_batch(batch % len(self.dataset))
            if not builders:
                raise EnvContractError(
                    f"{type(self.dataset).__name__}.get_batch({batch % len(self.dataset)}) returned {builders!r:.40}; "
                    "every batch needs at least one group"
                )
            for index, builder in enumerate(builders):
                await self.outbox.put(RolloutItem(GroupKey(batch, index), builder, len(builders)))
        self.outbox.close()


class InflightGate:
    """Admission by samples (the ``inflight`` scheduler) and the ledger that gives each finished
    group its training step.

    A group admitted while the sampler holds version v has a *deadline*: it must train at a step
    ≤ v + m (``m`` = ``max_steps_off_policy``), so its oldest token is at most m steps stale. The
    gate admits the next group whenever that stays feasible, i.e. when the groups not yet given
    a step fit the slots left in the steps up to v + m::

        uncommitted + 1 ≤ (B − committed in step s) + (v + m − s) · B

    (s = the step being filled, B = ``batch_size``; the same count of admitted groups as
    ``async``, but one group at a time, so a finished group's slot is refilled at once.)

    Finished groups are given to steps in order of deadline, then arrival (earliest deadline
    first), whatever batch of the dataset they came from: a step no longer waits for the slowest
    group of one batch. A group is committed to step s only if every group due before its own
    deadline still fits the slots that remain; when one that is due is still running, the
    ledger holds step s for it (``overdue="hold"``: the learner waits), or, once the learner has
    nothing else to train, restarts it with the current weights (``"regenerate"``: its old tokens
    are thrown away, it keeps its place and gets a new deadline). No group is ever dropped for
    being slow. ``benchmarks/RESULTS.md`` ("In-flight updates") measures the two.
    """

    def __init__(
        self,
        dataset: RLDataset,
        outbox: Channel[RolloutItem],
        sampler: SamplerActor,
        steps: range,
        max_steps_off_policy: int,
        batch_size: int,
        overdue: str = "hold",
        regenerate: Callable[[GroupKey], bool] | None = None,
    ):
        if overdue not in ("hold", "regenerate"):
            raise ValueError(f"overdue must be 'hold' or 'regenerate', not {overdue!r}")
        self.dataset = check_dataset(dataset, "train(dataset=...)")
        self.outbox, self.sampler, self.steps = outbox, sampler, steps
        self.m, self.batch_size, self.overdue, self._regenerate = max_steps_off_policy, batch_size, overdue, regenerate
        self.step, self.committed = steps.start, 0
        self.outstanding: dict[GroupKey, int] = {}  # admitted, not finished: dataset key → deadline
        self._pool: list[tuple[int, int, ProcessedGroup]] = []  # finished: heap of (deadline, arrival, group)
        self._arrivals = 0
        self._received_all = False
        self._changed = anyio.Event()
        sampler.on_version(lambda _: self._notify())
        # what the ledger did, for tests and benchmarks
        self.held_s = 0.0  # time a finished group waited for a due one (the learner may be idle)
        self.regenerated = 0
        self.inbox: Channel[ProcessedGroup] | None = None
        self.learner_q: Channel[ProcessedGroup] | None = None

    def wire(self, inbox: Channel[ProcessedGroup], learner_q: Channel[ProcessedGroup]) -> None:
        """Finished groups come from ``inbox``; they go to the learner on ``learner_q``, keyed by step."""
        self.inbox, self.learner_q = inbox, learner_q

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _uncommitted(self) -> int:
        return len(self.outstanding) + len(self._pool)

    def can_admit(self) -> bool:
        room = (self.batch_size - self.committed) + (self.sampler.version + self.m - self.step) * self.batch_size
        return self._uncommitted() + 1 <= room

    async def run(self) -> None:
        """Admission: the dataset's groups in order, each as soon as the bound allows it."""
        for batch in self.steps:
            builders = self.dataset.get_batch(batch % len(self.dataset))
            if len(builders) != self.batch_size:
                raise EnvContractError(
                    f"{type(self.dataset).__name__}.get_batch({batch % len(self.dataset)}) returned {len(builders)} "
                    f"groups; the inflight scheduler trains steps of exactly batch_size={self.batch_size} groups, "
                    "so every batch must have that many (or use the async scheduler)"
                )
            for index, builder in enumerate(builders):
                while not self.can_admit():
                    await self._changed.wait()
                key = GroupKey(batch, index)
                self.outstanding[key] = self.sampler.version + self.m
                await self.outbox.put(RolloutItem(key, builder, len(builders)))
        self.outbox.close()

    async def assign(self) -> None:
        """The ledger: finished groups → steps (see the class docstring)."""
        assert self.inbox is not None and self.learner_q is not None, "InflightGate.wire() first"
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._receive, self.inbox)
            while self.step < self.steps.stop:
                group = self._commit_next()
                if group is not None:
                    await self.learner_q.put(group)
                    continue
                if self._received_all and not self._pool:
                    break
                if self._pool and self.overdue == "regenerate" and self._regenerate_due():
                    continue
                waited = time.perf_counter()
                await self._changed.wait()
                if self._pool:
                    self.held_s += time.perf_counter() - waited
            tg.cancel_scope.cancel()
        self.learner_q.close()

    async def _receive(self, inbox: Channel[ProcessedGroup]) -> None:
        async for group in inbox:
            deadline = self.outstanding.pop(group.key)
            heapq.heappush(self._pool, (deadline, self._arrivals, group))
            self._arrivals += 1
            self._notify()
        self._received_all = True
        self._notify()

    def _blocked_until(self, deadline: int) -> int | None:
        """The first step t in [s, deadline) whose due groups would no longer fit if one more
        slot of step s were taken now; None when committing a group due at ``deadline`` is safe."""
        due = sorted([*self.outstanding.values(), *(d for d, _, _ in self._pool[1:])])
        left = self.batch_size - self.committed - 1
        i = 0
        for t in range(self.step, deadline):
            while i < len(due) and due[i] <= t:
                i += 1
            if i > left + (t - self.step) * self.batch_size:
                return t
        return None

    def _commit_next(self) -> ProcessedGroup | None:
        if not self._pool:
            return None
        deadline = self._pool[0][0]
        if self._blocked_until(deadline) is not None:
            return None
        _, _, group = heapq.heappop(self._pool)
        slot = self.committed
        self.committed += 1
        step = self.step
        if self.committed == self.batch_size:
            self.step, self.committed = self.step + 1, 0
        self._notify()
        return dataclasses.replace(group, key=GroupKey(step, slot), batch_size=self.batch_size)

    def _regenerate_due(self) -> bool:
        """Restart the running group with the earliest deadline, once the learner has trained
        every step before the one being filled (holding would idle it). True if one was restarted."""
        version = self.sampler.version
        if self._regenerate is None or version < self.step or not self.outstanding:
            return False
        key, deadline = min(self.outstanding.items(), key=lambda kv: kv[1])
        if deadline >= version + self.m or not self._regenerate(key):
            return False
        self.outstanding[key] = version + self.m
        self.regenerated += 1
        return True

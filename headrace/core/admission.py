"""Admission: what feeds groups to the rollout workers, each only when the scheduler allows it.

``AdmissionGate``: batch k is admitted once the sampler holds weights of version ≥ k − lag: lag 0
is on-policy (sync, stream); lag m bounds staleness by admission (async) instead of discarding
finished work; batch k trains at step k. ``InflightGate`` (the ``inflight`` scheduler) admits
group by group instead, and gives finished groups their steps: a pure, synchronous
``InflightLedger`` (the bound and the assignment, unit-tested alone) and two actors around it,
``InflightAdmit`` and ``InflightAssign``. Each kind gives the graph the actors it runs
(``actors()``) and its figures for the step's row (``figures()``).

(Not ``serve/gate.py``: that one judges ``headrace serve``'s candidates.)
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import anyio

from headrace.core.advantage_actor import ProcessedGroup
from headrace.core.channel import Channel
from headrace.core.episode import EnvContractError
from headrace.core.errors import ConfigError
from headrace.core.rollout import RolloutItem
from headrace.core.sampler import SamplerActor
from headrace.core.types import GroupKey, RLDataset

Actor = Callable[[], Coroutine[Any, Any, None]]  # an actor's run method, started in the graph's task group


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


class Admission(Protocol):
    """What the actor graph runs for admission (``run/graph.py``)."""

    def actors(self) -> list[Actor]:
        """The actors to start beside the others."""
        ...

    def figures(self) -> dict[str, float]:
        """What it reports in each step's row (cumulative)."""
        ...


class AdmissionGate:
    """Admission by batch (``sync``, ``stream``, ``async``)."""

    def __init__(self, dataset: RLDataset, outbox: Channel[RolloutItem], sampler: SamplerActor, steps: range, lag: int):
        self.dataset = check_dataset(dataset, "train(dataset=...)")
        self.outbox, self.sampler, self.steps, self.lag = outbox, sampler, steps, lag

    def actors(self) -> list[Actor]:
        return [self.run]

    def figures(self) -> dict[str, float]:
        return {}

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


class InflightLedger:
    """The ``inflight`` scheduler's bookkeeping, synchronous and pure (no tasks, no clock): which
    group may be admitted and which finished group trains at which step. Its actors
    (``InflightAdmit``, ``InflightAssign``) wait; it only decides.

    A group admitted while the sampler holds version v has a *deadline*: it must train at a step
    ≤ v + m (``m`` = ``max_steps_off_policy``), so its oldest token is at most m steps stale. The
    next group may be admitted whenever that stays feasible, i.e. when the groups not yet given
    a step fit the slots left in the steps up to v + m::

        uncommitted + 1 ≤ (B − committed in step s) + (v + m − s) · B

    (s = the step being filled, B = ``batch_size``; the same count of admitted groups as
    ``async``, but one group at a time, so a finished group's slot is refilled at once.)

    Finished groups are given to steps in order of deadline, then arrival (earliest deadline
    first), whatever batch of the dataset they came from: a step no longer waits for the slowest
    group of one batch. A group is committed to step s only if every group due before its own
    deadline still fits the slots that remain; when one that is due is still running, step s is
    held for it (``commit`` returns None), or it is restarted with the current weights
    (``overdue`` names it; ``restarted`` gives it a new deadline). No group is ever dropped for
    being slow. ``benchmarks/RESULTS.md`` ("In-flight updates") measures the two.
    """

    def __init__(self, steps: range, max_steps_off_policy: int, batch_size: int):
        self.steps, self.m, self.batch_size = steps, max_steps_off_policy, batch_size
        self.step, self.committed = steps.start, 0  # the step being filled, and its groups so far
        self.outstanding: dict[GroupKey, int] = {}  # admitted, not finished: dataset key → deadline
        self._pool: list[tuple[int, int, ProcessedGroup]] = []  # finished: heap of (deadline, arrival, group)
        self._arrivals = 0
        self.regenerated = 0  # running groups restarted with newer weights

    @property
    def waiting(self) -> int:
        """Finished groups not yet given a step."""
        return len(self._pool)

    @property
    def done(self) -> bool:
        return self.step >= self.steps.stop

    def can_admit(self, version: int) -> bool:
        room = (self.batch_size - self.committed) + (version + self.m - self.step) * self.batch_size
        return len(self.outstanding) + len(self._pool) + 1 <= room

    def admit(self, key: GroupKey, version: int) -> None:
        self.outstanding[key] = version + self.m

    def arrive(self, group: ProcessedGroup) -> None:
        """A finished group, waiting for its step."""
        deadline = self.outstanding.pop(group.key)
        heapq.heappush(self._pool, (deadline, self._arrivals, group))
        self._arrivals += 1

    def commit(self) -> ProcessedGroup | None:
        """The next finished group with its step set, or None: none waits, or the one due first
        must wait for a running group due earlier (the step is held for it)."""
        if not self._pool or self._blocked_until(self._pool[0][0]) is not None:
            return None
        _, _, group = heapq.heappop(self._pool)
        step = self.step
        self.committed += 1
        if self.committed == self.batch_size:
            self.step, self.committed = self.step + 1, 0
        return dataclasses.replace(group, step=step, batch_size=self.batch_size)

    def overdue(self, version: int) -> GroupKey | None:
        """The running group to restart with the current weights (``version``), once the learner
        has trained every step before the one being filled (holding would idle it): the one with
        the earliest deadline, if that deadline is behind what it would get now."""
        if version < self.step or not self.outstanding:
            return None
        key, deadline = min(self.outstanding.items(), key=lambda kv: kv[1])
        return key if deadline < version + self.m else None

    def restarted(self, key: GroupKey, version: int) -> None:
        self.outstanding[key] = version + self.m
        self.regenerated += 1

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


class _Changed:
    """Wakes whoever waits for the ledger to change (a new version, an arrival, a commit)."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = anyio.Event()

    async def wait(self) -> None:
        await self._event.wait()


class InflightAdmit:
    """The admission actor: the dataset's groups in order, each as soon as the ledger allows it."""

    def __init__(
        self,
        dataset: RLDataset,
        outbox: Channel[RolloutItem],
        sampler: SamplerActor,
        ledger: InflightLedger,
        changed: _Changed,
    ):
        self.dataset, self.outbox, self.sampler, self.ledger, self.changed = dataset, outbox, sampler, ledger, changed

    async def run(self) -> None:
        batch_size = self.ledger.batch_size
        for batch in self.ledger.steps:
            builders = self.dataset.get_batch(batch % len(self.dataset))
            if len(builders) != batch_size:
                raise EnvContractError(
                    f"{type(self.dataset).__name__}.get_batch({batch % len(self.dataset)}) returned {len(builders)} "
                    f"groups; the inflight scheduler trains steps of exactly batch_size={batch_size} groups, "
                    "so every batch must have that many (or use the async scheduler)"
                )
            for index, builder in enumerate(builders):
                while not self.ledger.can_admit(self.sampler.version):
                    await self.changed.wait()
                key = GroupKey(batch, index)
                self.ledger.admit(key, self.sampler.version)
                await self.outbox.put(RolloutItem(key, builder, len(builders)))
        self.outbox.close()


class InflightAssign:
    """The assignment actor: finished groups (from ``inbox``) to the learner (``learner_q``),
    each with its step, as the ledger commits them; with ``overdue="regenerate"`` it restarts a
    running group the ledger names (through ``regenerate``, the rollout actor's) instead of
    holding the learner."""

    def __init__(
        self,
        inbox: Channel[ProcessedGroup],
        learner_q: Channel[ProcessedGroup],
        sampler: SamplerActor,
        ledger: InflightLedger,
        changed: _Changed,
        overdue: str = "hold",
        regenerate: Callable[[GroupKey], bool] | None = None,
    ):
        if overdue not in ("hold", "regenerate"):
            raise ValueError(f"overdue must be 'hold' or 'regenerate', not {overdue!r}")
        self.inbox, self.learner_q, self.sampler, self.ledger, self.changed = inbox, learner_q, sampler, ledger, changed
        self.regenerate = regenerate if overdue == "regenerate" else None
        self.held_s = 0.0  # time finished groups waited for a due one (the learner may be idle)
        self._received_all = False

    async def run(self) -> None:
        ledger = self.ledger
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._receive)
            while not ledger.done:
                group = ledger.commit()
                if group is not None:
                    self.changed.notify()  # a slot taken: admission may go on
                    await self.learner_q.put(group)
                    continue
                if self._received_all and not ledger.waiting:
                    break
                if ledger.waiting and self._restart_overdue():
                    continue
                waited = time.perf_counter()
                await self.changed.wait()
                if ledger.waiting:
                    self.held_s += time.perf_counter() - waited
            tg.cancel_scope.cancel()
        self.learner_q.close()

    async def _receive(self) -> None:
        async for group in self.inbox:
            self.ledger.arrive(group)
            self.changed.notify()
        self._received_all = True
        self.changed.notify()

    def _restart_overdue(self) -> bool:
        if self.regenerate is None:
            return False
        version = self.sampler.version
        key = self.ledger.overdue(version)
        if key is None or not self.regenerate(key):
            return False
        self.ledger.restarted(key, version)
        return True


class InflightGate:
    """Admission by samples (the ``inflight`` scheduler): the ledger and its two actors, woken
    by a new version, an arrival or a commit."""

    def __init__(
        self,
        dataset: RLDataset,
        outbox: Channel[RolloutItem],
        finished: Channel[ProcessedGroup],
        learner_q: Channel[ProcessedGroup],
        sampler: SamplerActor,
        steps: range,
        max_steps_off_policy: int,
        batch_size: int,
        overdue: str = "hold",
        regenerate: Callable[[GroupKey], bool] | None = None,
    ):
        self.ledger = InflightLedger(steps, max_steps_off_policy, batch_size)
        changed = _Changed()
        sampler.on_version(lambda _: changed.notify())
        dataset = check_dataset(dataset, "train(dataset=...)")
        self.admit = InflightAdmit(dataset, outbox, sampler, self.ledger, changed)
        self.assign = InflightAssign(finished, learner_q, sampler, self.ledger, changed, overdue, regenerate)

    def actors(self) -> list[Actor]:
        return [self.admit.run, self.assign.run]

    def figures(self) -> dict[str, float]:
        return {"inflight/held_s": self.assign.held_s, "inflight/regenerated": float(self.ledger.regenerated)}

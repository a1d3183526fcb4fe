"""LearnerActor: batches → ``forward_backward`` / ``optim_step`` calls with pipelined futures.

Two tasks share the work. The submitter assembles each step and submits its calls without
awaiting them; the completer awaits the results in order, publishes the new weights to the
sampler and reports the step. So while the device runs step k, Python already prepares (and,
when the data is there, submits) step k+1: the device never waits on Python.

Step k trains the groups of batch k (the reorder buffer holds groups of later batches that
finish first); with ``minibatches > 1`` a ``forward_backward`` goes out each time enough groups
of the batch have arrived, and one ``optim_step`` closes the batch.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio

from headrace.core.advantage_actor import ProcessedGroup
from headrace.core.channel import Channel
from headrace.core.protocols import TrainingBackend
from headrace.core.retry import Backoff, retry_transient
from headrace.core.sampler import SamplerActor
from headrace.core.trace import CallCompleted, CallCounter, CallSubmitted, Tracer
from headrace.core.types import AdamParams, ForwardBackwardResult, LossSpec, OptimResult, SamplerHandle

R = TypeVar("R")


@dataclass(frozen=True)
class LearnerSettings:
    minibatches: int  # forward_backward calls per step (1: the whole batch at once)
    loss: LossSpec
    adam: AdamParams
    save_every: int = 0
    backoff: Backoff = Backoff()  # for a submission refused with a transient error


@dataclass(frozen=True)
class Submitted(Generic[R]):
    """A training call on its way: its result arrives through ``future``."""

    op: str
    call: int  # numbered per op, in submission order
    future: Awaitable[R]


@dataclass
class PendingStep:
    step: int
    groups: list[ProcessedGroup] = field(default_factory=list)
    forward_backwards: list[Submitted[ForwardBackwardResult]] = field(default_factory=list)
    optim: Submitted[OptimResult] | None = None
    publish: Submitted[SamplerHandle] = None  # type: ignore[assignment]
    checkpoint: str | None = None
    last_group_at: float = 0.0  # when the batch's last group was taken


@dataclass
class StepReport:
    step: int
    groups: list[ProcessedGroup]
    forward_backwards: list[ForwardBackwardResult]
    optim: OptimResult | None
    version: int
    checkpoint: str | None
    completed_at: float
    last_group_at: float = 0.0  # when the batch's last group reached the learner


class LearnerActor:
    def __init__(
        self,
        inbox: Channel[ProcessedGroup],
        training: TrainingBackend,
        sampler: SamplerActor,
        settings: LearnerSettings,
        steps: range,
        on_step: Callable[[StepReport], Awaitable[None]],
        tracer: Tracer | None = None,
    ):
        self.inbox, self.training, self.sampler, self.settings = inbox, training, sampler, settings
        self.steps, self.on_step = steps, on_step
        self._tracer, self._calls = tracer, CallCounter()
        self._buffer: dict[int, list[ProcessedGroup]] = defaultdict(list)
        self.completed = steps.start  # steps trained, published and reported
        self._stop_requested = False
        self._assembling: anyio.CancelScope | None = None  # set while a step's data is awaited

    async def run(self) -> None:
        pending: Channel[PendingStep] = Channel(maxsize=1, name="learner_pending")
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._submit_all, pending)
            tg.start_soon(self._complete_all, pending)

    def request_stop(self) -> None:
        """Stop at the next step boundary: a step whose optimizer call is submitted still
        finishes and is reported, so a checkpoint taken afterwards is exactly "after step k"."""
        self._stop_requested = True
        if self._assembling is not None:
            self._assembling.cancel()

    async def _submit_all(self, pending: Channel[PendingStep]) -> None:
        # A stop only interrupts the wait for a step's data (the weights are untouched then); it
        # is not a cancellation, so when the run fails instead, everything here is cancelled and
        # nothing waits, shielded, on a completer that is gone.
        for step in self.steps:
            p = None
            if not self._stop_requested:
                with anyio.CancelScope() as self._assembling:
                    p = await self._submit_minibatches(step)
                self._assembling = None
            if p is None:
                break
            await self._finish_step(p)
            await pending.put(p)
        pending.close()

    async def _next_group_of(self, step: int) -> ProcessedGroup:
        while not self._buffer[step]:
            group = await self.inbox.get()
            self._buffer[group.step].append(group)
        return self._buffer[step].pop(0)

    async def _submit_minibatches(self, step: int) -> PendingStep:
        pending = PendingStep(step)
        first = await self._next_group_of(step)
        total = first.batch_size
        per_minibatch = math.ceil(total / self.settings.minibatches)
        minibatch = [first]
        pending.groups.append(first)
        while True:
            if len(minibatch) == per_minibatch or len(pending.groups) == total:
                # in the batch's order, not the order the groups finished in: the same data
                # trains the same way (float sums, microbatches) however the rollouts were timed
                datums = [d for g in sorted(minibatch, key=position) for d in g.datums]
                if datums:
                    pending.forward_backwards.append(
                        await self._call("forward_backward", self.training.forward_backward, datums, self.settings.loss)
                    )
                minibatch = []
            if len(pending.groups) == total:
                pending.last_group_at = time.perf_counter()
                pending.groups.sort(key=position)  # the step's figures too
                break
            group = await self._next_group_of(step)
            pending.groups.append(group)
            minibatch.append(group)
        self._buffer.pop(step, None)
        return pending

    async def _finish_step(self, pending: PendingStep) -> None:
        step = pending.step
        if pending.forward_backwards:
            pending.optim = await self._call("optim_step", self.training.optim_step, self.settings.adam)
        pending.publish = await self._call("publish", self.training.publish, step + 1)
        if self.settings.save_every and (step + 1) % self.settings.save_every == 0 and step + 1 < self.steps.stop:
            # in submission order, so the saved state is exactly "after step k"
            pending.checkpoint = await self.training.save_state(f"step_{step + 1:06d}")

    async def _call(self, op: str, fn: Callable[..., Awaitable[R]], *args: Any) -> Submitted[R]:
        """Submit a call and return without waiting for it. A submission refused with a
        transient error applied nothing, so it is simply retried."""
        future = await retry_transient(self.settings.backoff, _submit, fn, *args)
        call = self._calls.take(op)
        if self._tracer is not None:
            self._tracer(CallSubmitted(op, call, None, time.perf_counter()))
        return Submitted(op, call, future)

    async def _result(self, submitted: Submitted[R]) -> R:
        result = await submitted.future
        if self._tracer is not None:
            self._tracer(CallCompleted(submitted.op, submitted.call, None, time.perf_counter()))
        return result

    async def _complete_all(self, pending: Channel[PendingStep]) -> None:
        async for p in pending:
            forward_backwards = [await self._result(f) for f in p.forward_backwards]
            optim: OptimResult | None = None
            if p.optim is not None:
                optim = await self._result(p.optim)
            handle = await self._result(p.publish)
            await self.sampler.weights.put(handle)
            await self.sampler.wait_for_version(handle.version)
            await self.on_step(
                StepReport(
                    p.step,
                    p.groups,
                    forward_backwards,
                    optim,
                    handle.version,
                    p.checkpoint,
                    time.perf_counter(),
                    p.last_group_at,
                )
            )
            self.completed = p.step + 1


def position(group: ProcessedGroup) -> tuple[int, int]:
    """Where a group stands in the dataset: its batch, then its index in the batch."""
    return group.key.batch, group.key.index


async def _submit(fn: Callable[..., Awaitable[R]], *args: Any) -> Awaitable[R]:
    return fn(*args)

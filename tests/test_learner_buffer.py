"""The learner's reorder buffer, driven by hand: groups arrive in the order the test puts them, and
a recording device shows which groups each call trained.

Step k trains exactly the groups of batch k, whatever order they finish in: a group of a later
batch that arrives first is held for its own step, never trained early or dropped; with
minibatches, a ``forward_backward`` goes out as soon as enough groups of the step are in. Each
call trains its groups in the batch's order, not in the order they finished (the same data trains
the same way however the rollouts were timed).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import anyio
import pytest

from headrace.core.advantage_actor import ProcessedGroup
from headrace.core.channel import Channel
from headrace.core.learner import LearnerActor, LearnerSettings, StepReport
from headrace.core.sampler import SamplerActor
from headrace.core.types import AdamParams, Datum, GroupKey, LossSpec, SamplerHandle

pytestmark = pytest.mark.timeout(20)


def group(batch: int, index: int, batch_size: int) -> ProcessedGroup:
    """A group whose one datum names it: its input token is 100·batch + index."""
    datum = Datum([100 * batch + index], [0], [0.0], [1.0], [1.0])
    return ProcessedGroup(GroupKey(batch, index), batch, batch_size, [datum], "trained", policy_version=batch)


class Device:
    """A training backend that records each call (forward_backward: the groups it trained) and
    answers at once."""

    def __init__(self):
        self.calls: list[tuple[str, list[int] | int | None]] = []

    def _done(self, value):
        future = asyncio.get_running_loop().create_future()
        future.set_result(value)
        return future

    def forward_backward(self, datums, loss):
        self.calls.append(("forward_backward", [d.model_input[0] for d in datums]))
        return self._done(None)

    def optim_step(self, adam):
        self.calls.append(("optim_step", None))
        return self._done(None)

    def publish(self, version):
        self.calls.append(("publish", version))
        return self._done(SamplerHandle(version, ref=None))

    async def save_state(self, name):
        return name


class Sampling:
    async def sample(self, *args):
        raise AssertionError("the learner never samples")


@asynccontextmanager
async def running_learner(steps: range, minibatches: int = 1):
    """A learner on a hand-fed inbox; yields (inbox, device, reports) while it runs."""
    inbox: Channel[ProcessedGroup] = Channel(64, "learner")
    device, reports = Device(), []
    sampler = SamplerActor(Sampling(), SamplerHandle(steps.start, ref=None))

    async def report(step: StepReport) -> None:
        reports.append(step)

    policy = LearnerSettings(minibatches=minibatches, loss=LossSpec(), adam=AdamParams())
    learner = LearnerActor(inbox, device, sampler, policy, steps, report)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sampler.run)

        async def learn():
            await learner.run()
            sampler.weights.close()

        tg.start_soon(learn)
        yield inbox, device, reports


async def feed(inbox: Channel[ProcessedGroup], *groups: ProcessedGroup) -> None:
    for g in groups:
        await inbox.put(g)
    await anyio.wait_all_tasks_blocked()  # the learner has taken in all it can


def leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in leaves(e)]
    return [error]


def trained(device: Device) -> list[list[int]]:
    return [ids for op, ids in device.calls if op == "forward_backward"]


async def test_groups_of_a_later_batch_that_arrive_first_are_held_for_their_own_step():
    with anyio.fail_after(10):
        async with running_learner(range(0, 3)) as (inbox, device, reports):
            # batch 1 and part of batch 2 finish before anything of batch 0
            await feed(inbox, group(1, 0, 2), group(2, 1, 2), group(1, 1, 2))
            assert device.calls == [], "a group of a later batch was trained as step 0"
            await feed(inbox, group(0, 1, 2))
            assert device.calls == [], "step 0 went out before its batch was complete"
            await feed(inbox, group(0, 0, 2))
            # steps 0 and 1 now train, each on its own batch; batch 2 waits for its last group
            assert trained(device) == [[0, 1], [100, 101]]
            assert [r.step for r in reports] == [0, 1]
            await feed(inbox, group(2, 0, 2))
    assert trained(device) == [[0, 1], [100, 101], [200, 201]]
    assert [op for op, _ in device.calls] == ["forward_backward", "optim_step", "publish"] * 3
    for report in reports:
        assert {g.key.batch for g in report.groups} == {report.step}, (
            f"step {report.step} trained another batch's groups"
        )
        assert report.version == report.step + 1


async def test_a_minibatch_goes_out_once_its_groups_are_in_and_only_those():
    with anyio.fail_after(10):
        async with running_learner(range(0, 2), minibatches=2) as (inbox, device, reports):
            # interleaved with batch 1: only batch 0's groups make step 0's first minibatch
            await feed(inbox, group(0, 2, 4), group(1, 0, 4), group(1, 3, 4))
            assert device.calls == []
            await feed(inbox, group(0, 0, 4))
            assert device.calls == [("forward_backward", [0, 2])], (
                "the first minibatch waited for the rest of the batch"
            )
            await feed(inbox, group(1, 1, 4), group(0, 3, 4), group(1, 2, 4))
            assert [op for op, _ in device.calls] == ["forward_backward"], "the batch is not complete yet"
            await feed(inbox, group(0, 1, 4))
            assert trained(device) == [[0, 2], [1, 3], [100, 103], [101, 102]]
    assert [op for op, _ in device.calls] == ["forward_backward", "forward_backward", "optim_step", "publish"] * 2
    assert [r.step for r in reports] == [0, 1]


@pytest.mark.timeout(10)
async def test_a_failing_report_ends_the_learner_instead_of_hanging_it():
    """The submitter runs ahead and waits, shielded, to hand over a step whose optimizer call is
    out; when the completer fails (a report that raises: a full disk, a broken callback), nobody
    will take that step, and the learner must end with the error rather than wait forever."""
    inbox: Channel[ProcessedGroup] = Channel(64, "learner")
    sampler = SamplerActor(Sampling(), SamplerHandle(0, ref=None))

    async def report(step: StepReport) -> None:
        await anyio.wait_all_tasks_blocked()  # the submitter is as far ahead as it can get
        raise OSError("no space left on device")

    policy = LearnerSettings(minibatches=1, loss=LossSpec(), adam=AdamParams())
    learner = LearnerActor(inbox, Device(), sampler, policy, range(0, 6), report)
    for batch in range(6):
        await inbox.put(group(batch, 0, 1))
    raised: list[str] = []
    try:
        with anyio.fail_after(5):  # a hang shielded from this still fails, by the test's timeout
            async with anyio.create_task_group() as tg:
                tg.start_soon(sampler.run)
                await learner.run()
    except* OSError as errors:
        raised = [str(e) for e in leaves(errors)]
    assert "no space left on device" in raised, "the report's error did not end the learner"


async def test_a_stop_ends_the_learner_at_a_step_boundary():
    """A stop while the learner waits for a step's data ends it there: the steps whose optimizer
    call went out are finished and reported, nothing of the next is trained."""
    inbox: Channel[ProcessedGroup] = Channel(64, "learner")
    device, reports = Device(), []
    sampler = SamplerActor(Sampling(), SamplerHandle(0, ref=None))

    async def report(step: StepReport) -> None:
        reports.append(step.step)

    policy = LearnerSettings(minibatches=2, loss=LossSpec(), adam=AdamParams())
    learner = LearnerActor(inbox, device, sampler, policy, range(0, 4), report)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler.run)
            tg.start_soon(learner.run)
            # step 0 complete, step 1 half in: its first minibatch is out, the second never comes
            await feed(inbox, group(0, 0, 2), group(0, 1, 2), group(1, 0, 2))
            learner.request_stop()
            await anyio.wait_all_tasks_blocked()
            sampler.weights.close()
    assert reports == [0] and learner.completed == 1
    # step 1's first minibatch went out, but no optimizer step applied it
    ops = [op for op, _ in device.calls]
    assert ops == ["forward_backward", "forward_backward", "optim_step", "publish", "forward_backward"]

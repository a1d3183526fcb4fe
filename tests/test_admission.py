"""The admission gate, driven by hand: batch k goes out only once the sampler holds weights of
version ≥ k − lag, in order, every group of it, and the gate closes its outbox at the end."""

from __future__ import annotations

import anyio
import pytest

from headrace.core.admission import AdmissionGate
from headrace.core.channel import Channel, ChannelClosed
from headrace.core.rollout import RolloutItem
from headrace.core.sampler import SamplerActor
from headrace.core.types import SamplerHandle

pytestmark = pytest.mark.timeout(20)

GROUPS = 3  # per batch


class Batches:
    """A dataset of named builders: batch i is ["i/0", "i/1", "i/2"]."""

    def __len__(self) -> int:
        return 100

    def get_batch(self, index: int) -> list[str]:
        return [f"{index}/{g}" for g in range(GROUPS)]


class Sampling:
    async def sample(self, *args):
        raise AssertionError("the gate never samples")


async def admitted(outbox: Channel[RolloutItem], seen: list[RolloutItem]) -> list[int]:
    """The batches admitted so far, taking what the outbox holds (it has room for every batch,
    so taking frees nothing the gate waits for)."""
    while outbox.qsize():
        try:
            seen.append(await outbox.get())
        except ChannelClosed:
            break
    return sorted({item.key.batch for item in seen})


@pytest.mark.parametrize("lag", [0, 1, 2])
async def test_batch_k_is_admitted_only_once_the_sampler_holds_version_k_minus_lag(lag):
    steps = range(0, 6)
    outbox: Channel[RolloutItem] = Channel(len(steps) * GROUPS, "rollout")  # room for all: only the gate holds back
    sampler = SamplerActor(Sampling(), SamplerHandle(0, ref=None))
    gate = AdmissionGate(Batches(), outbox, sampler, steps, lag)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler.run)
            tg.start_soon(gate.run)
            seen: list[RolloutItem] = []
            for version in range(0, len(steps)):
                if version:
                    await sampler.weights.put(SamplerHandle(version, ref=None))
                await anyio.wait_all_tasks_blocked()
                allowed = list(range(0, min(version + lag, len(steps) - 1) + 1))
                assert await admitted(outbox, seen) == allowed, f"at version {version}, lag {lag}"
            sampler.weights.close()
    assert outbox.closed
    assert [(i.key.batch, i.key.index, i.builder, i.batch_size) for i in seen] == [
        (b, g, f"{b}/{g}", GROUPS) for b in steps for g in range(GROUPS)
    ]


async def test_admission_follows_the_version_not_the_number_of_publishes():
    """A resumed run starts at a later step and version; a version that skips ahead admits
    every batch it allows at once."""
    outbox: Channel[RolloutItem] = Channel(64, "rollout")
    sampler = SamplerActor(Sampling(), SamplerHandle(10, ref=None))
    gate = AdmissionGate(Batches(), outbox, sampler, range(10, 16), lag=1)
    seen: list[RolloutItem] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler.run)
            tg.start_soon(gate.run)
            await anyio.wait_all_tasks_blocked()
            assert await admitted(outbox, seen) == [10, 11]
            await sampler.weights.put(SamplerHandle(13, ref=None))
            await anyio.wait_all_tasks_blocked()
            assert await admitted(outbox, seen) == [10, 11, 12, 13, 14]
            await sampler.weights.put(SamplerHandle(14, ref=None))
            sampler.weights.close()
    assert await admitted(outbox, seen) == [10, 11, 12, 13, 14, 15]

"""Continuous batching in the torch sampler (issue 24): a request that joins a running decode batch
between two steps, or leaves it cancelled, changes nothing the other rows compute (the padding,
attention mask and positions of rows of other prompt lengths), beyond float round-off."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.torch_helpers import config, datum

torch = pytest.importorskip("torch")

from headrace.core.types import AdamParams, LossSpec, SamplingParams, StopReason  # noqa: E402
from headrace.run.backends import make_backend  # noqa: E402

SLICE = 3  # decode steps of the first batch before the others arrive
TOL = 1e-4  # float32: logprobs of one row with other rows beside it, or not


def _same(alone, joined) -> None:
    assert len(alone) == len(joined)
    for a, b in zip(alone, joined, strict=True):
        assert a.tokens == b.tokens and a.stop_reason == b.stop_reason
        assert a.policy_version == b.policy_version
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)), default=0.0) < TOL


async def _idle(sampler) -> None:
    """Until the decode loop of the requests before has stopped (a request issued while it runs
    would join it at once)."""
    while not sampler.idle():
        await asyncio.sleep(0.001)


async def _held(backend):
    """Hold the device thread once the running loop's first slice is done: returns the release."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(30)

    await asyncio.sleep(0)  # sample() has queued the loop's first slice
    backend._device_thread.submit_threadsafe(hold)
    await asyncio.to_thread(entered.wait, 30)
    return release


def _requests(backend):
    tok = backend.tokenizer
    running = (tok.encode("12+30="), 2, SamplingParams(max_tokens=12, temperature=1.0, seed=11))
    longer = (tok.encode("what is 123+456+789=?"), 3, SamplingParams(max_tokens=6, temperature=0.0))
    shorter = (tok.encode("7="), 2, SamplingParams(max_tokens=9, temperature=1.0, seed=5))
    return running, longer, shorter


@pytest.mark.timeout(60)
async def test_a_request_that_joins_a_running_batch_samples_what_it_samples_alone():
    async with make_backend(config(sample_batch_wait_s=0.0)) as backend:
        sampler, handle = backend.sampling, backend.initial_handle()
        sampler.slice_steps = SLICE
        running, longer, shorter = _requests(backend)
        alone = [await sampler.sample(handle, *r) for r in (running, longer, shorter)]
        # a stop token of its own for the shorter one: the third token it drew alone
        stop = alone[2][0].tokens[2]
        stopping = SamplingParams(max_tokens=9, temperature=1.0, seed=5, stop_token_ids=(stop,))
        shorter = (shorter[0], shorter[1], stopping)
        alone[2] = await sampler.sample(handle, *shorter)
        assert alone[2][0].stop_reason == StopReason.STOP and alone[2][0].tokens[-1] == stop
        await _idle(sampler)
        before, joined_before = sampler.batches, sampler.joined
        first = asyncio.ensure_future(sampler.sample(handle, *running))
        release = await _held(backend)
        # a longer prompt than the running rows' cache and a shorter one, issued mid-decode
        joiners = [asyncio.ensure_future(sampler.sample(handle, *r)) for r in (longer, shorter)]
        await asyncio.sleep(0)
        release.set()
        joined = [await first, *[await j for j in joiners]]
        # they joined the running batch after its first slice, none started its own
        assert sampler.batches == before + 1 and sampler.joined == joined_before + 5
    for a, b in zip(alone, joined, strict=True):
        _same(a, b)


@pytest.mark.timeout(60)
async def test_a_cancelled_request_leaves_the_batch_without_changing_the_others():
    async with make_backend(config(sample_batch_wait_s=0.0)) as backend:
        sampler, handle = backend.sampling, backend.initial_handle()
        sampler.slice_steps = SLICE
        running, longer, shorter = _requests(backend)
        together = await asyncio.gather(*[sampler.sample(handle, *r) for r in (running, longer, shorter)])
        await _idle(sampler)
        tasks = [asyncio.ensure_future(sampler.sample(handle, *r)) for r in (running, longer, shorter)]
        release = await _held(backend)
        tasks[0].cancel()  # its group's retry budget spent: nobody waits for its rows
        await asyncio.sleep(0)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
        rest = [await t for t in tasks[1:]]
        assert sampler._running.abandoned == 2  # its rows left at the next step, the others went on
        await asyncio.wait_for(_idle(sampler), 10)  # idle again: nothing left behind
    for a, b in zip(together[1:], rest, strict=True):
        _same(a, b)


@pytest.mark.timeout(60)
async def test_a_newer_version_starts_its_own_batch_beside_the_draining_one():
    async with make_backend(config(sample_batch_wait_s=0.0)) as backend:
        sampler, v0 = backend.sampling, backend.initial_handle()
        sampler.slice_steps = SLICE
        running, longer, _ = _requests(backend)
        samples = await sampler.sample(v0, *running)
        await backend.training.forward_backward(
            [datum(running[0], s, 1.0 if i % 2 else -1.0) for i, s in enumerate(samples)],
            LossSpec("importance_sampling"),
        )
        await backend.training.optim_step(AdamParams(learning_rate=3e-2))
        v1 = await backend.training.publish(1)
        alone = [await sampler.sample(v0, *running), await sampler.sample(v1, *longer)]
        await _idle(sampler)
        before = sampler.batches
        old = asyncio.ensure_future(sampler.sample(v0, *running))
        release = await _held(backend)
        new = asyncio.ensure_future(sampler.sample(v1, *longer))
        await asyncio.sleep(0)
        release.set()
        both = [await old, await new]
        assert sampler.batches == before + 2  # one version per batch
    assert {s.policy_version for s in both[0]} == {0} and {s.policy_version for s in both[1]} == {1}
    for a, b in zip(alone, both, strict=True):
        _same(a, b)


@pytest.mark.timeout(60)
async def test_under_inflight_swaps_a_request_of_the_new_version_joins_the_batch_that_took_it():
    async with make_backend(config(sample_batch_wait_s=0.0)) as backend:
        sampler, v0 = backend.sampling, backend.initial_handle()
        sampler.slice_steps = SLICE
        running, longer, _ = _requests(backend)
        samples = await sampler.sample(v0, *running)
        await backend.training.forward_backward(
            [datum(running[0], s, 1.0 if i % 2 else -1.0) for i, s in enumerate(samples)],
            LossSpec("importance_sampling"),
        )
        await backend.training.optim_step(AdamParams(learning_rate=3e-2))
        v1 = await backend.training.publish(1)
        sampler.swap_weights(v0)  # swap mode on
        alone = await sampler.sample(v1, *longer)
        await _idle(sampler)
        before, joined_before = sampler.batches, sampler.joined
        old = asyncio.ensure_future(sampler.sample(v0, *running))
        release = await _held(backend)
        sampler.swap_weights(v1)  # as the sampler actor does on a new version, then the next request
        new = asyncio.ensure_future(sampler.sample(v1, *longer))
        await asyncio.sleep(0)
        release.set()
        swapped, joined = await old, await new
        assert sampler.batches == before + 1 and sampler.joined == joined_before + 3
    # the running rows took version 1 after their first slice, then the joiner sampled beside them
    for s in swapped:
        assert s.versions == [0] * SLICE + [1] * (len(s.tokens) - SLICE)
    _same(alone, joined)

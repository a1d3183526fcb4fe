"""The bare-asyncio floor the engine's overhead is measured against.

The same graph as a run on a zero-latency backend, with nothing of the engine in it: a producer
puts one item per group into a bounded queue (the admission gate → rollout queue hop); each of
``workers`` workers takes an item, yields once for the group's sample (the engine samples a
group's shared first action in one ``n=G`` call, and the zero-latency sim's ``sample`` is one
``await asyncio.sleep(0)``), starts one task per trajectory in an ``asyncio.TaskGroup`` (the
engine's member episodes), and puts the group into a second queue (→ reward); a relay moves it
to a third (→ learner); a consumer counts the trajectories. Per trajectory: one task; per group:
one yield, one task group and three queue hops, as in the engine. No envs, no tokens, no
datums, no versions: what is left is the cost of asyncio itself.
"""

from __future__ import annotations

import asyncio
import time

_DONE = None


async def floor_trajectories_per_s(groups: int, group_size: int, workers: int, queue_size: int) -> float:
    """Trajectories per second through the bare graph (one measurement)."""
    rollout_q: asyncio.Queue = asyncio.Queue(queue_size)
    results_q: asyncio.Queue = asyncio.Queue(queue_size)
    learner_q: asyncio.Queue = asyncio.Queue(queue_size)
    counted = 0

    async def member() -> int:
        return 1

    async def produce() -> None:
        for g in range(groups):
            await rollout_q.put(g)
        for _ in range(workers):
            await rollout_q.put(_DONE)

    async def work() -> None:
        while (item := await rollout_q.get()) is not _DONE:
            await asyncio.sleep(0)  # the group's one sample call
            async with asyncio.TaskGroup() as tg:
                members = [tg.create_task(member()) for _ in range(group_size)]
            await results_q.put((item, [m.result() for m in members]))

    async def workers_then_close() -> None:
        async with asyncio.TaskGroup() as tg:
            for _ in range(workers):
                tg.create_task(work())
        await results_q.put(_DONE)

    async def relay() -> None:
        while (group := await results_q.get()) is not _DONE:
            await learner_q.put(group)
        await learner_q.put(_DONE)

    async def consume() -> None:
        nonlocal counted
        while (group := await learner_q.get()) is not _DONE:
            counted += len(group[1])

    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for coro in (produce(), workers_then_close(), relay(), consume()):
            tg.create_task(coro)
    elapsed = time.perf_counter() - start
    assert counted == groups * group_size
    return counted / elapsed


async def measure_floor(groups: int, group_size: int, workers: int, queue_size: int, repeats: int = 3) -> float:
    """The best of ``repeats`` measurements (the floor is a bound: its best run is the fairest)."""
    return max([await floor_trajectories_per_s(groups, group_size, workers, queue_size) for _ in range(repeats)])

"""``core/settle.py``: a callback once the event loop has nothing else to run, what the torch
sampler's reproducible batches rest on (``tests/test_reproducible.py`` runs whole commands)."""

from __future__ import annotations

import asyncio
import time

from headrace.core import settle


async def test_call_when_settled_waits_for_every_task_that_can_run():
    """What the reproducible batches rest on: the callback runs once every task that could run
    has run as far as it can (here, to its fifth yield), not after a fixed time."""
    progress: list[int] = []
    seen: list[list[int]] = []

    async def busy(i: int) -> None:
        for _ in range(5):
            await asyncio.sleep(0)
        progress.append(i)
        await asyncio.Event().wait()  # blocked from now on

    tasks = [asyncio.create_task(busy(i)) for i in range(3)]
    settle.call_when_settled(lambda: seen.append(list(progress)))
    settle.call_when_settled(lambda: seen.append(list(progress)))  # a second caller shares the one check
    await asyncio.sleep(0.05)
    assert seen == [[0, 1, 2], [0, 1, 2]]
    for t in tasks:
        t.cancel()


async def test_a_loop_that_never_settles_still_calls_back(monkeypatch):
    monkeypatch.setattr(settle, "SETTLE_LIMIT_S", 0.1)
    called = asyncio.Event()

    async def poll_forever() -> None:
        while True:
            await asyncio.sleep(0)

    poller = asyncio.create_task(poll_forever())
    begun = time.monotonic()
    settle.call_when_settled(called.set)
    await asyncio.wait_for(called.wait(), 5)
    assert time.monotonic() - begun >= 0.1
    poller.cancel()

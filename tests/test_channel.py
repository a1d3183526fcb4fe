"""The closable bounded channel under the actors."""

from __future__ import annotations

import anyio
import pytest

from headrace.core.channel import Channel, ChannelClosed

pytestmark = pytest.mark.timeout(10)


async def test_bounded_put_waits_for_room_and_close_drains_first():
    ch: Channel[int] = Channel(2, "t")
    await ch.put(1)
    await ch.put(2)
    with anyio.move_on_after(0.05) as scope:
        await ch.put(3)
    assert scope.cancelled_caught, "a full channel accepted a third item"
    ch.close()
    assert [x async for x in ch] == [1, 2]
    with pytest.raises(ChannelClosed):
        await ch.put(4)
    assert ch.peak == 2


async def test_close_wakes_every_consumer():
    ch: Channel[int] = Channel(1, "t")
    seen = []

    async def consume():
        async for item in ch:
            seen.append(item)

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(consume)
        await ch.put(7)
        ch.close()
    assert seen == [7]

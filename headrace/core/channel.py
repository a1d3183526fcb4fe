"""A bounded, closable channel on ``asyncio.Queue``.

asyncio queues cost less per item than anyio memory streams on this hot path (benchmarks/RESULTS.md,
"Measured design choices"), but
3.11 has no ``Queue.shutdown``; closing is what tells consumers that the data has ended, so it
lives here once instead of as sentinels scattered through the actors.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

from headrace.core.errors import RunError

T = TypeVar("T")


class ChannelClosed(RunError):
    """Raised by ``get`` on a closed, drained channel and by ``put`` on a closed one."""


_CLOSED = object()


class Channel(Generic[T]):
    def __init__(self, maxsize: int, name: str = "channel"):
        if maxsize < 1:
            raise ValueError(f"channel '{name}' needs maxsize >= 1 (queues are bounded)")
        self.name = name
        self.maxsize = maxsize
        # Unbounded queue + a slot semaphore: the bound applies to items, and the close marker
        # always fits, so closing never has to wait for a consumer.
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._slots = asyncio.Semaphore(maxsize)
        self._closed = False
        self.peak = 0  # deepest the queue has been: bounded memory is checked from this

    @property
    def closed(self) -> bool:
        return self._closed

    def qsize(self) -> int:
        return self._queue.qsize()

    async def put(self, item: T) -> None:
        if self._closed:
            raise ChannelClosed(self.name)
        await self._slots.acquire()
        if self._closed:
            self._slots.release()
            raise ChannelClosed(self.name)
        self._queue.put_nowait(item)
        size = self._queue.qsize()
        if size > self.peak:
            self.peak = size

    async def get(self) -> T:
        item = await self._queue.get()
        if item is _CLOSED:
            self._queue.put_nowait(_CLOSED)  # wake the next consumer too
            raise ChannelClosed(self.name)
        self._slots.release()
        return item  # type: ignore[return-value]

    def close(self) -> None:
        """No more puts; consumers drain what is queued, then see ``ChannelClosed``."""
        if self._closed:
            return
        self._closed = True
        self._queue.put_nowait(_CLOSED)

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[T]:
        while True:
            try:
                yield await self.get()
            except ChannelClosed:
                return

"""Lock-step clock cycles, as on the hosted service: training ops wait for a cycle boundary and
every op queued by then runs in that cycle, in arrival order (the SDK sends one client's
requests in seq order). A model's op that arrives within ``follow_s`` of its previous op joins
that op's cycle, so ``forward_backward`` and ``optim_step`` submitted back to back always share
a cycle, while an op submitted after its predecessor's result came back waits for the next one.

With ``clock_cycle_s == 0`` there is no grid: queued ops run at once, one batch per "cycle".
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass
class QueuedOp:
    model_id: str
    run: Callable[[int], Awaitable[None]]  # called with the cycle index
    arrived: float


class Clock:
    def __init__(self, cycle_s: float, follow_s: float):
        self.cycle_s = cycle_s
        self.follow_s = follow_s
        self.cycles = 0
        self._queue: list[QueuedOp] = []
        self._wake = asyncio.Event()
        self._t0 = time.monotonic()

    def submit(self, model_id: str, run: Callable[[int], Awaitable[None]]) -> None:
        self._queue.append(QueuedOp(model_id, run, time.monotonic()))
        self._wake.set()

    async def _next_boundary(self) -> None:
        if self.cycle_s <= 0:
            return
        elapsed = time.monotonic() - self._t0
        k = math.ceil(elapsed / self.cycle_s)
        await asyncio.sleep(max(self._t0 + k * self.cycle_s - time.monotonic(), 0.0))

    async def _collect(self) -> list[QueuedOp]:
        batch, self._queue = self._queue, []
        if self.cycle_s <= 0 or self.follow_s <= 0:
            return batch
        last = {op.model_id: op.arrived for op in batch}
        while True:  # stragglers of the models already in this cycle
            joined = [
                op for op in self._queue if op.model_id in last and op.arrived - last[op.model_id] <= self.follow_s
            ]
            if joined:
                for op in joined:
                    self._queue.remove(op)
                    last[op.model_id] = op.arrived
                batch.extend(joined)
                continue
            wait = max(last.values()) + self.follow_s - time.monotonic()
            if wait <= 0:
                return batch
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except TimeoutError:
                pass

    async def run(self) -> None:
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            await self._next_boundary()
            batch = await self._collect()
            cycle = self.cycles
            self.cycles += 1
            for op in batch:
                await op.run(cycle)

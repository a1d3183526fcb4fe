"""Lock-step clock cycles, as on the hosted service: training ops wait for a cycle boundary and
every op queued by then runs in that cycle, in arrival order (the SDK sends one client's
requests in seq order).

Hard boundaries by default: an op that arrives after a boundary waits for the next one, even if
its model's previous op is running in the cycle that boundary opened. That is all the service
promises; ``forward_backward`` and ``optim_step`` share a cycle only if both were queued before
its boundary. ``follow_s`` (knob, ``--follow-s``) relaxes this: a model's op arriving within
``follow_s`` of its previous op joins that op's cycle.

``max_ops_per_cycle`` (knob, ``--max-ops-per-cycle``) models the service conservatively: at most
that many compute ops (``forward``, ``forward_backward``, ``optim_step``) of one model run in a
cycle, so 2 is one ``forward_backward`` + ``optim_step`` pair. Once a model's next compute op
would go over, it and everything queued behind it for that model (saves and loads too: a model's
ops never change order) wait for the next cycle. Saves and loads do not count.

With ``clock_cycle_s == 0`` there is no grid: queued ops run at once, one batch per "cycle".
Each op is run with two numbers: ``cycle``, the index of the batch it ran in (cycles that ran no
work are not counted), and ``grid_cycle``, the index of the boundary that opened it on the grid
(``None`` without one), so idle cycles show as gaps.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

# the ops a cycle's capacity is spent on (saves and loads ride along)
COMPUTE_OPS = frozenset({"forward", "forward_backward", "optim_step"})

RunOp = Callable[[int, "int | None"], Awaitable[None]]  # called with (cycle, grid cycle)


class ClockKnobs(Protocol):
    clock_cycle_s: float
    follow_s: float
    max_ops_per_cycle: int


@dataclass
class QueuedOp:
    model_id: str
    op: str
    run: RunOp
    arrived: float


class Clock:
    """Read the knobs on every cycle: ``POST /emulator/knobs`` changes them while it runs."""

    def __init__(self, knobs: ClockKnobs):
        self.knobs = knobs
        self.cycles = 0
        self._queue: list[QueuedOp] = []
        self._wake = asyncio.Event()
        self._t0 = time.monotonic()

    def submit(self, model_id: str, op: str, run: RunOp) -> None:
        self._queue.append(QueuedOp(model_id, op, run, time.monotonic()))
        self._wake.set()

    async def _next_boundary(self) -> int | None:
        """Sleep until the next boundary on the grid; its index (None without a grid)."""
        cycle_s = self.knobs.clock_cycle_s
        if cycle_s <= 0:
            return None
        k = math.ceil((time.monotonic() - self._t0) / cycle_s)
        await asyncio.sleep(max(self._t0 + k * cycle_s - time.monotonic(), 0.0))
        return k

    def _take(self, candidates: list[QueuedOp], spent: dict[str, int], full: set[str]) -> list[QueuedOp]:
        """The ops of ``candidates`` this cycle can take, in order; the rest stay queued. ``spent``
        counts each model's compute ops so far this cycle; ``full`` holds the models that hit
        the cap (nothing more of theirs runs this cycle)."""
        cap = self.knobs.max_ops_per_cycle
        taken = []
        for op in candidates:
            if op.model_id in full:
                continue
            if cap and op.op in COMPUTE_OPS:
                if spent.get(op.model_id, 0) >= cap:
                    full.add(op.model_id)
                    continue
                spent[op.model_id] = spent.get(op.model_id, 0) + 1
            taken.append(op)
        chosen = {id(op) for op in taken}
        self._queue = [op for op in self._queue if id(op) not in chosen]
        return taken

    async def _collect(self) -> list[QueuedOp]:
        spent: dict[str, int] = {}
        full: set[str] = set()
        batch = self._take(list(self._queue), spent, full)
        follow_s = self.knobs.follow_s
        if self.knobs.clock_cycle_s <= 0 or follow_s <= 0 or not batch:
            return batch
        last: dict[str, float] = {}
        for op in batch:
            last[op.model_id] = op.arrived
        while True:  # stragglers of the models already in this cycle
            stragglers = []
            for op in self._queue:
                if op.model_id in last and op.arrived - last[op.model_id] <= follow_s:
                    stragglers.append(op)
            joined = self._take(stragglers, spent, full)
            if joined:
                for op in joined:
                    last[op.model_id] = op.arrived
                batch.extend(joined)
                continue
            wait = max(last.values()) + follow_s - time.monotonic()
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
            grid = await self._next_boundary()
            batch = await self._collect()
            cycle = self.cycles
            self.cycles += 1
            for op in batch:
                await op.run(cycle, grid)

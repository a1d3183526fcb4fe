"""``call_when_settled(fn)``: call ``fn()`` once the event loop has nothing else to run.

What a reproducible sampler batches on (``sampling.batch_reproducibly()``, sync runs): the
requests pending once every task that could run has run, and so has either asked for its sample
or waits on something else (its partner's move, a thread, a timer). When the code between two
samples waits on nothing outside the loop, that set is the same in every run; the set that arrives
within a time window is not (it depends on how fast the machine ran the rollouts).

Asyncio has no public "idle" hook, so the loop's queue of ready callbacks (``_ready``, there in
every CPython release since 3.4) is read directly: while it holds anything, the check goes to the
back of it. A loop without one (uvloop) counts as settled at once. One check runs per loop
whatever the number of callers (two checks re-queuing themselves would each see the other as work
forever), and a loop that stays busy past ``SETTLE_LIMIT_S`` (a task polling with ``sleep(0)``)
is called settled then, so nothing waits on it forever.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable

from headrace.core import logs

log = logs.get_logger()

# how long a loop may stay busy before its waiting callbacks run anyway (seconds)
SETTLE_LIMIT_S = 2.0

_waiting: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[Callable[[], None]]] = weakref.WeakKeyDictionary()


def call_when_settled(fn: Callable[[], None]) -> None:
    """Call ``fn()`` on this loop once nothing else is ready to run (must be called on the loop)."""
    loop = asyncio.get_running_loop()
    waiting = _waiting.get(loop)
    if waiting is not None:
        waiting.append(fn)
        return
    _waiting[loop] = [fn]
    loop.call_soon(_check, loop, loop.time() + SETTLE_LIMIT_S)


def _check(loop: asyncio.AbstractEventLoop, deadline: float) -> None:
    if getattr(loop, "_ready", None):
        if loop.time() < deadline:
            loop.call_soon(_check, loop, deadline)
            return
        log.warning("loop_never_settled", limit_s=SETTLE_LIMIT_S, effect="a batch formed without waiting for it")
    for fn in _waiting.pop(loop, []):
        fn()

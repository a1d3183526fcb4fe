"""Actors Ray restarts (rollout workers, sampler replicas), as the driver sees them: which are
live, and each dead one brought back in the backend's task group and left out of the choice until
then. A call that fails marks its actor down only if no restart happened since the call went out
(its generation): a failure of an older process is old news."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from headrace.core import logs
from headrace.core.errors import BackendFailure

from .runtime import import_ray

log = logs.get_logger()
# how long Ray may take to restart a dead actor (a call waits that long when all of a kind are down)
RESTART_TIMEOUT_S = 300.0


@dataclass(eq=False)
class Member:
    index: int
    actor: Any
    live: bool = True
    restarts: int = 0  # also its generation


M = TypeVar("M", bound=Member)


class Members(Generic[M]):
    """``come_back(member)`` readies a restarted actor (it raises Ray's ``ActorUnavailableError``,
    or one of ``restarting``, while the process is not up yet); it is retried until it succeeds,
    for up to ``RESTART_TIMEOUT_S``, after which the run fails."""

    def __init__(
        self,
        kind: str,
        members: list[M],
        come_back: Callable[[M], Awaitable[None]],
        restarting: tuple[type[BaseException], ...] = (),
    ):
        self.kind, self.all = kind, members
        self._come_back, self._restarting = come_back, restarting
        self._live = asyncio.Event()
        self._live.set()
        self._tasks: asyncio.TaskGroup | None = None
        self._recovering: list[asyncio.Task[None]] = []

    def attach(self, tasks: asyncio.TaskGroup) -> None:
        self._tasks = tasks  # where restarts are watched: one that cannot come back fails the run

    async def stop(self) -> None:
        for task in self._recovering:
            task.cancel()

    @property
    def restarts(self) -> int:
        return sum(m.restarts for m in self.all)

    async def pick(self, key: Callable[[M], Any]) -> M:
        """The live member that ``key`` puts first; waits while none is live."""
        while True:
            live = [m for m in self.all if m.live]
            if live:
                return min(live, key=key)
            self._live.clear()
            try:
                await asyncio.wait_for(self._live.wait(), RESTART_TIMEOUT_S)
            except TimeoutError:
                raise BackendFailure(
                    f"no {self.kind.replace('_', ' ')} came back within {RESTART_TIMEOUT_S:.0f} s after they died; "
                    "see the Ray logs (/tmp/ray/session_latest/logs) for why they cannot start"
                ) from None

    def down(self, member: M, generation: int, error: BaseException) -> None:
        if member.restarts != generation or not member.live:
            return
        member.live = False
        member.restarts += 1
        log.warning(f"{self.kind}_died", index=member.index, error=f"{type(error).__name__}: {error}"[:300])
        assert self._tasks is not None, "attach() to the backend's task group first"
        self._recovering = [t for t in self._recovering if not t.done()]
        name = f"{self.kind}-{member.index}-restart"
        self._recovering.append(self._tasks.create_task(self._bring_back(member), name=name))

    async def _bring_back(self, member: M) -> None:
        ray = import_ray()
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while True:
            try:
                await self._come_back(member)
                break
            except (ray.exceptions.ActorUnavailableError, *self._restarting):  # still restarting, or died again
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        member.live = True
        self._live.set()
        log.info(f"{self.kind}_back", index=member.index)

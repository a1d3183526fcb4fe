"""Rollout workers: N processes that build and step the envs, each running many at once on its
own event loop.

The driver keeps each episode's loop (sampling goes through the router from there) and sends
every env call to the worker that holds the env: ``RemoteGroupBuilder`` stands in for a group
builder and its envs, so the rollout actor, its retry budget and the schedulers run unchanged.
Builders are pickled to the workers; envs are made, stepped, scored and cleaned up there, never on
the driver. A worker that dies is restarted by Ray; the calls it was serving fail, and the rollout
actor re-runs those members with fresh envs under the group's retry budget, on the other workers
until it answers again.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from headrace.core.errors import BackendError
from headrace.core.types import Env as _Env
from headrace.core.types import (
    EnvGroupBuilder,
    Metrics,
    RLDataset,
    SampledTokens,
    StepResult,
    StopCondition,
    Tokens,
    Trajectory,
)

from .restarts import Member, Members
from .runtime import import_ray


class WorkerDied(BackendError, RuntimeError):
    """A rollout worker died under an env call: the member is re-run with a fresh env."""


class WorkerRestarted(BackendError, RuntimeError):
    """Raised by a worker Ray restarted since it opened the group: the group's envs died with the
    old process."""


class RolloutWorker:
    """Runs in its own process (a Ray actor): the envs of the groups it was given."""

    def __init__(self, index: int):
        self.index = index
        self.groups: dict[int, tuple[EnvGroupBuilder, list[_Env]]] = {}

    async def open(self, gid: int, builder: EnvGroupBuilder) -> int:
        envs = list(await builder.make_envs())
        self.groups[gid] = (builder, envs)
        return len(envs)

    def _env(self, gid: int, i: int) -> _Env:
        held = self.groups.get(gid)
        if held is None:
            raise WorkerRestarted(f"rollout worker {self.index} was restarted and no longer holds group {gid}")
        return held[1][i]

    async def initial(self, gid: int, i: int) -> tuple[Tokens, StopCondition]:
        return await self._env(gid, i).initial_observation()

    async def step(self, gid: int, i: int, action: SampledTokens) -> StepResult:
        return await self._env(gid, i).step(action)

    async def group_rewards(
        self, gid: int, builder: EnvGroupBuilder, trajectories: Sequence[Trajectory]
    ) -> list[tuple[float, Metrics]]:
        held = self.groups.get(gid)
        return await (held[0] if held else builder).compute_group_rewards(trajectories)

    async def cleanup(self, gid: int) -> None:
        held = self.groups.pop(gid, None)
        if held is not None:
            await held[0].cleanup()

    def ping(self) -> int:
        return self.index


@dataclass(eq=False)
class _Worker(Member):
    open_groups: int = 0


class WorkerPool:
    """The driver's view of the rollout workers. A worker whose call fails is left out of the
    choice until Ray has restarted it and it answers a ping: a retry that landed on it while it
    was restarting would fail at once, and a group's members could spend their whole retry
    budget on it in milliseconds (seen on a loaded CI machine)."""

    def __init__(self, actors: list[Any]):
        self.actors = actors
        self.workers = Members("rollout_worker", [_Worker(i, a) for i, a in enumerate(actors)], self._ping)
        self._ids = itertools.count()

    @property
    def restarts(self) -> int:
        return self.workers.restarts

    async def pick(self) -> int:
        """The live worker with the fewest open groups; waits while none is live."""
        return (await self.workers.pick(lambda w: w.open_groups)).index

    def opened(self, worker: int, change: int) -> None:
        self.workers.all[worker].open_groups += change

    def new_id(self) -> int:
        return next(self._ids)

    async def call(self, worker: int, method: str, *args: Any) -> Any:
        ray = import_ray()
        held = self.workers.all[worker]
        generation = held.restarts
        try:
            return await getattr(held.actor, method).remote(*args)
        except ray.exceptions.RayActorError as e:
            self.workers.down(held, generation, e)
            raise WorkerDied(f"rollout worker {worker} died during {method}() ({type(e).__name__})") from e
        except WorkerRestarted as e:  # it died between two calls and is back: only the group is lost
            raise WorkerDied(f"rollout worker {worker} died since it opened this group (restarted)") from e

    @staticmethod
    async def _ping(worker: _Worker) -> None:
        await worker.actor.ping.remote()


class RemoteEnv(_Env):
    def __init__(self, pool: WorkerPool, worker: int, gid: int, index: int):
        self.pool, self.worker, self.gid, self.index = pool, worker, gid, index

    async def initial_observation(self) -> tuple[Tokens, StopCondition]:
        return await self.pool.call(self.worker, "initial", self.gid, self.index)

    async def step(self, action: SampledTokens) -> StepResult:
        return await self.pool.call(self.worker, "step", self.gid, self.index, action)


class RemoteGroupBuilder(EnvGroupBuilder):
    """A group builder whose envs live on a rollout worker; a retry's ``make_envs`` may land on
    another (or the restarted) worker."""

    def __init__(self, builder: EnvGroupBuilder, pool: WorkerPool):
        self.builder, self.pool = builder, pool
        self._opened: list[tuple[int, int]] = []  # (worker, group id) of every make_envs

    async def make_envs(self) -> Sequence[_Env]:
        worker, gid = await self.pool.pick(), self.pool.new_id()
        self.pool.opened(worker, +1)
        self._opened.append((worker, gid))
        n = await self.pool.call(worker, "open", gid, self.builder)
        return [RemoteEnv(self.pool, worker, gid, i) for i in range(n)]

    async def compute_group_rewards(self, trajectories_G: Sequence[Trajectory]) -> list[tuple[float, Metrics]]:
        # on the worker holding the newest envs (the builder's state there); if it died, a fresh copy elsewhere
        worker, gid = self._opened[-1] if self._opened else (await self.pool.pick(), -1)
        try:
            return await self.pool.call(worker, "group_rewards", gid, self.builder, list(trajectories_G))
        except WorkerDied:
            return await self.pool.call(await self.pool.pick(), "group_rewards", -1, self.builder, list(trajectories_G))

    async def cleanup(self) -> None:
        opened, self._opened = self._opened, []
        for worker, gid in opened:
            self.pool.opened(worker, -1)
            try:
                await self.pool.call(worker, "cleanup", gid)
            except WorkerDied:
                pass  # its envs died with it

    def logging_tags(self) -> list[str]:
        return self.builder.logging_tags()


class RemoteDataset(RLDataset):
    def __init__(self, dataset: RLDataset, pool: WorkerPool):
        self.dataset, self.pool = dataset, pool

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [RemoteGroupBuilder(b, self.pool) for b in self.dataset.get_batch(index)]

    def __len__(self) -> int:
        return len(self.dataset)

"""Rollout workers: N processes that build and step the envs, each running many at once on its
own event loop.

The driver keeps each episode's loop (sampling goes through the router from there) and sends
every env call to the worker that holds the env: ``RemoteGroupBuilder`` stands in for a group
builder and its envs, so the rollout actor, its retry budget and the schedulers run unchanged.
Builders are pickled to the workers; envs are made, stepped, scored and cleaned up there, never on
the driver. A worker that dies is restarted by Ray; the calls it was serving fail, and the rollout
actor re-runs those members with fresh envs under the group's retry budget.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

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

from .runtime import import_ray


class WorkerDied(RuntimeError):
    """A rollout worker died under an env call: the member is re-run with a fresh env."""


class RolloutWorker:
    """Runs in its own process (a Ray actor): the envs of the groups it was given."""

    def __init__(self, index: int):
        self.index = index
        self.groups: dict[int, tuple[EnvGroupBuilder, list[_Env]]] = {}

    async def open(self, gid: int, builder: EnvGroupBuilder) -> int:
        envs = list(await builder.make_envs())
        self.groups[gid] = (builder, envs)
        return len(envs)

    async def initial(self, gid: int, i: int) -> tuple[Tokens, StopCondition]:
        return await self.groups[gid][1][i].initial_observation()

    async def step(self, gid: int, i: int, action: SampledTokens) -> StepResult:
        return await self.groups[gid][1][i].step(action)

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


class WorkerPool:
    def __init__(self, actors: list[Any]):
        self.actors = actors
        self.open_groups = [0] * len(actors)
        self._ids = itertools.count()

    def pick(self) -> int:
        return min(range(len(self.actors)), key=lambda w: self.open_groups[w])

    def new_id(self) -> int:
        return next(self._ids)

    async def call(self, worker: int, method: str, *args: Any) -> Any:
        ray = import_ray()
        try:
            return await getattr(self.actors[worker], method).remote(*args)
        except ray.exceptions.RayActorError as e:
            raise WorkerDied(f"rollout worker {worker} died during {method}() ({type(e).__name__})") from e


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
        worker, gid = self.pool.pick(), self.pool.new_id()
        self.pool.open_groups[worker] += 1
        self._opened.append((worker, gid))
        n = await self.pool.call(worker, "open", gid, self.builder)
        return [RemoteEnv(self.pool, worker, gid, i) for i in range(n)]

    async def compute_group_rewards(self, trajectories_G: Sequence[Trajectory]) -> list[tuple[float, Metrics]]:
        # on the worker holding the newest envs (the builder's state there); if it died, a fresh copy elsewhere
        worker, gid = self._opened[-1] if self._opened else (self.pool.pick(), -1)
        try:
            return await self.pool.call(worker, "group_rewards", gid, self.builder, list(trajectories_G))
        except WorkerDied:
            return await self.pool.call(self.pool.pick(), "group_rewards", -1, self.builder, list(trajectories_G))

    async def cleanup(self) -> None:
        opened, self._opened = self._opened, []
        for worker, gid in opened:
            self.pool.open_groups[worker] -= 1
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

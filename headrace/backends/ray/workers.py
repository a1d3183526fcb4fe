"""Rollout workers: N processes that build and step the envs, each running many at once on its
own event loop.

The driver keeps each episode's loop (sampling goes through the router from there) and sends
every env call to the worker that holds the env: ``RemoteGroupBuilder`` stands in for a group
builder and its envs, so the rollout actor, its retry budget and the schedulers run unchanged.
Builders are pickled to the workers; envs are made, stepped, scored and cleaned up there, never on
the driver. A worker that dies is restarted by Ray; the calls it was serving fail, and the rollout
actor re-runs those members with fresh envs under the group's retry budget, on the other workers
until it answers again.

A self-driven env (an agent, ``headrace/agents``) runs on its worker too, its agent and its
endpoint there (on that worker's loopback: the agent's calls never leave its machine), while its
turns are sampled from the driver like any other episode's: ``RolloutWorker.drive`` is one
streaming call per episode that yields each turn the agent asks for, and the driver answers
each with ``drive_answer`` (which also applies the env's ``keep``). Those long calls run in a
concurrency group of their own (``DRIVEN``), so answers and the other envs' calls never wait
behind them; Ray gives that group its own event loop, so an answer reaches its episode through
that loop (``run_coroutine_threadsafe``).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from headrace.core.episode import EpisodeOver, Keep, Policy, is_self_driven, kept
from headrace.core.errors import BackendError, EnvError, root_cause
from headrace.core.types import Env as _Env
from headrace.core.types import (
    EnvGroupBuilder,
    Metrics,
    RLDataset,
    SampledTokens,
    StepResult,
    StopCondition,
    StopReason,
    Tokens,
    Trajectory,
)

from .restarts import Member, Members
from .runtime import import_ray

DRIVEN = "driven"  # the concurrency group of the self-driven episodes' long calls


class WorkerDied(BackendError, RuntimeError):
    """A rollout worker died under an env call: the member is re-run with a fresh env."""


class WorkerRestarted(BackendError, RuntimeError):
    """Raised by a worker Ray restarted since it opened the group: the group's envs died with the
    old process."""


class TurnFailed(EnvError, RuntimeError):
    """A self-driven episode's turn failed on the driver (its sampler): the episode fails, and
    the driver raises the turn's own error."""


@dataclass(eq=False)
class _Drive:
    """A self-driven episode on this worker: the loop it runs on, its turns waiting for the driver."""

    loop: asyncio.AbstractEventLoop
    task: asyncio.Task
    events: asyncio.Queue
    pending: dict[int, tuple[asyncio.Future, Keep | None]] = field(default_factory=dict)
    ids: itertools.count = field(default_factory=itertools.count)


class RolloutWorker:
    """Runs in its own process (a Ray actor): the envs of the groups it was given."""

    def __init__(self, index: int):
        self.index = index
        self.groups: dict[int, tuple[EnvGroupBuilder, list[_Env]]] = {}
        self.drives: dict[tuple[int, int], _Drive] = {}

    async def open(self, gid: int, builder: EnvGroupBuilder) -> list[bool]:
        """Make the group's envs; which of them drive their own episodes."""
        envs = list(await builder.make_envs())
        self.groups[gid] = (builder, envs)
        return [is_self_driven(env) for env in envs]

    async def drive(self, gid: int, i: int) -> AsyncIterator[tuple]:
        """Run a self-driven env's episode (a streaming call, in ``DRIVEN``): yields each turn it
        asks for, ``("turn", id, prompt, stop)``, a turn its caller gave up, ``("cancel", id)``,
        and at the end ``("result", StepResult)``; its error is the call's."""
        env = self._env(gid, i)
        task = asyncio.current_task()
        assert task is not None
        drive = self.drives[(gid, i)] = _Drive(asyncio.get_running_loop(), task, asyncio.Queue())

        async def policy(prompt: Tokens, stop: StopCondition, keep: Keep | None = None) -> SampledTokens:
            turn = next(drive.ids)
            answer = drive.loop.create_future()
            drive.pending[turn] = (answer, keep)
            drive.events.put_nowait(("turn", turn, prompt, stop))
            try:
                return await answer
            except asyncio.CancelledError:
                drive.events.put_nowait(("cancel", turn))
                raise
            finally:
                drive.pending.pop(turn, None)

        try:
            async with asyncio.TaskGroup() as tg:
                run = tg.create_task(env.drive(policy))  # type: ignore[attr-defined]
                run.add_done_callback(lambda _: drive.events.put_nowait(("end",)))
                while (event := await drive.events.get())[0] != "end":
                    yield event
            yield ("result", run.result())
        except BaseExceptionGroup as group:
            raise root_cause(group) from None
        finally:
            self.drives.pop((gid, i), None)

    async def drive_answer(
        self, gid: int, i: int, turn: int, action: SampledTokens | None, refused: tuple[str, str] | None
    ) -> int:
        """The driver's answer to a turn: its action (the count the env keeps comes back), or
        ``refused``: ``("over", reason, message)`` past the turn limit or the context, else
        ``("failed", message)``. A turn no longer waited for is dropped (its count: all)."""
        drive = self.drives.get((gid, i))
        if drive is None:
            return len(action.tokens) if action is not None else 0
        settle = self._settle(drive, turn, action, refused)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(settle, drive.loop))

    @staticmethod
    async def _settle(drive: _Drive, turn: int, action: SampledTokens | None, refused: tuple | None) -> int:
        answer, keep = drive.pending.get(turn, (None, None))
        if answer is None or answer.done():
            return len(action.tokens) if action is not None else 0
        if refused is not None or action is None:
            kind, *said = refused or ("failed", "no action")
            error = EpisodeOver(StopReason(said[0]), said[1]) if kind == "over" else TurnFailed(said[0])
            answer.set_exception(error)
            return 0
        try:
            n = keep(action) if keep is not None else len(action.tokens)
            if not isinstance(n, int):
                n = await n
            answer.set_result(kept(action, n))
        except Exception as e:
            answer.set_exception(e)
            raise
        return n

    def drive_cancel(self, gid: int, i: int | None = None) -> None:
        """End a self-driven episode (all of the group's: ``i`` None) that its driver gave up."""
        for (g, j), drive in list(self.drives.items()):
            if g == gid and i in (None, j):
                drive.loop.call_soon_threadsafe(drive.task.cancel)

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
        self.drive_cancel(gid)
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

    async def stream(self, worker: int, method: str, *args: Any) -> AsyncIterator[Any]:
        """A streaming call's items, in the ``DRIVEN`` group; errors as ``call``'s."""
        ray = import_ray()
        held = self.workers.all[worker]
        generation = held.restarts
        try:
            async for ref in getattr(held.actor, method).options(concurrency_group=DRIVEN).remote(*args):
                yield await ref
        except ray.exceptions.RayActorError as e:
            self.workers.down(held, generation, e)
            raise WorkerDied(f"rollout worker {worker} died during {method}() ({type(e).__name__})") from e
        except WorkerRestarted as e:
            raise WorkerDied(f"rollout worker {worker} died since it opened this group (restarted)") from e

    def tell(self, worker: int, method: str, *args: Any) -> None:
        """A call not waited for (its answer, or the worker's death, changes nothing)."""
        getattr(self.workers.all[worker].actor, method).remote(*args)

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


class RemoteDrivenEnv(_Env):
    """A self-driven env on a rollout worker: its agent runs there, its turns are sampled here
    (through ``policy``, the episode's, as for an env on the driver)."""

    def __init__(self, pool: WorkerPool, worker: int, gid: int, index: int):
        self.pool, self.worker, self.gid, self.index = pool, worker, gid, index

    async def drive(self, policy: Policy) -> StepResult:
        failures: list[BaseException] = []  # a turn's own error: the episode's, rather than the worker's copy
        result: StepResult | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                turns: dict[int, asyncio.Task] = {}
                async for event in self.pool.stream(self.worker, "drive", self.gid, self.index):
                    if event[0] == "turn":
                        turns[event[1]] = tg.create_task(self._turn(policy, event[1], event[2], event[3], failures))
                    elif event[0] == "cancel":
                        if (task := turns.pop(event[1], None)) is not None:
                            task.cancel()
                    else:
                        result = event[1]
                for task in turns.values():  # the agent returned: a turn still sampling has no caller
                    task.cancel()
        except asyncio.CancelledError:
            self.pool.tell(self.worker, "drive_cancel", self.gid, self.index)
            raise
        except BaseExceptionGroup as group:
            raise root_cause(group) from None
        except Exception:
            if failures:
                raise failures[0] from None
            raise
        assert result is not None
        return result

    async def _turn(self, policy: Policy, turn: int, prompt: Tokens, stop: StopCondition, failures: list) -> None:
        async def keep(action: SampledTokens) -> int:
            return await self.pool.call(self.worker, "drive_answer", self.gid, self.index, turn, action, None)

        try:
            await policy(prompt, stop, keep)
        except EpisodeOver as e:
            refused: tuple = ("over", e.reason.value, str(e))
        except Exception as e:  # noqa: BLE001 - the episode fails with it (raised by drive)
            failures.append(e)
            refused = ("failed", f"{type(e).__name__}: {e}")
        else:
            return
        await self.pool.call(self.worker, "drive_answer", self.gid, self.index, turn, None, refused)

    async def initial_observation(self) -> tuple[Tokens, StopCondition]:
        raise NotImplementedError("a self-driven env is driven (drive), never stepped")

    async def step(self, action: SampledTokens) -> StepResult:
        raise NotImplementedError("a self-driven env is driven (drive), never stepped")


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
        driven = await self.pool.call(worker, "open", gid, self.builder)
        return [(RemoteDrivenEnv if d else RemoteEnv)(self.pool, worker, gid, i) for i, d in enumerate(driven)]

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

"""Sampler replicas: M processes, each with the run's backend and its own copy of the weights,
and the router on the driver that sends each request to the live replica with the fewest
outstanding.

A publish reaches every live replica before it resolves (so before the gate counts the version as
published): the weights go into Ray's shared-memory object store once and each replica reads them
from there. A replica that dies leaves the router; Ray restarts its process, and the router gives
it back the versions still in use before it takes requests again. The requests it was serving fail
as transient errors, which the sampler actor retries on the others (or waits for it). A replica
restarted between two requests (none saw it die) says so on the next, which the router takes as
the same news.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from headrace.core import logs
from headrace.core.protocols import TransientBackendError
from headrace.core.types import SampledTokens, SamplerHandle, SamplingParams, Tokens

from .runtime import RESTART_TIMEOUT_S, import_ray, local_config, until_one_is_back

log = logs.get_logger()


class ReplicaRestarted(RuntimeError):
    """Raised by a replica Ray restarted between two requests, so none of them saw it die: it
    serves nothing until the router has started it again and given it back its versions."""


class SamplerReplica:
    """Runs in its own process (a Ray actor): the run's backend, used for sampling only."""

    def __init__(self, config: dict[str, Any], index: int, keep: int):
        self.config, self.index, self.keep = local_config(config, run_dir=None), index, keep
        self._stack = contextlib.AsyncExitStack()
        self.backend: Any = None
        self.handles: dict[int, SamplerHandle] = {}
        self.serving = False

    async def start(self, serving: bool = True) -> dict[str, Any]:
        """Builds the backend; a restarted replica is started with ``serving=False`` and serves
        once ``resume`` says it holds every version in use again."""
        from headrace.run.backends import make_backend

        if self.backend is None:
            self.backend = await self._stack.enter_async_context(make_backend(self.config))
            self.handles = {0: self.backend.initial_handle()}
        self.serving = serving
        sampling = self.backend.sampling
        return {"max_context": getattr(sampling, "max_context", None), "tokenizer": self.backend.tokenizer}

    def resume(self) -> None:
        self.serving = True

    async def load(self, version: int, weights: Any) -> float:
        if self.backend is None:
            raise ReplicaRestarted(f"sampler replica {self.index} was restarted and has not been started again")
        started = time.perf_counter()
        self.handles[version] = self.backend.handle_for(version, weights)
        for old in [v for v in self.handles if v <= max(self.handles) - self.keep]:
            del self.handles[old]  # no request of the run can still ask for it
        return time.perf_counter() - started

    async def sample(self, version: int, prompt: Tokens, n: int, params: SamplingParams) -> list[SampledTokens]:
        if not self.serving:
            raise ReplicaRestarted(f"sampler replica {self.index} was restarted and is not serving again yet")
        handle = self.handles.get(version)
        if handle is None:
            raise RuntimeError(f"sampler replica {self.index} holds versions {sorted(self.handles)}, not {version}")
        return await self.backend.sampling.sample(handle, prompt, n, params)

    async def stop(self) -> None:
        await self._stack.aclose()


@dataclass
class _Slot:
    index: int
    actor: Any
    outstanding: int = 0
    live: bool = True
    receiving: bool = False  # restarted, not serving yet, but given each publish
    restarts: int = 0  # also its generation: a failure seen by a request of an older one is old news
    recovering: asyncio.Task[None] | None = field(default=None, repr=False)


class ReplicaRouter:
    """The sampling side of the cluster backend: ``SamplingBackend`` over the replicas."""

    def __init__(self, actors: list[Any], max_context: int | None, keep: int):
        self._slots = [_Slot(i, a) for i, a in enumerate(actors)]
        self.max_context = max_context
        self._keep = keep
        self._weights: dict[int, Any] = {}  # version -> ObjectRef, the versions a restarted replica needs
        self._live = asyncio.Event()
        self._live.set()
        self._tasks: asyncio.TaskGroup | None = None
        self.last_publish_s: float | None = None  # the last publish to every live replica

    def attach(self, tasks: asyncio.TaskGroup) -> None:
        self._tasks = tasks  # where restarts are watched: a failure there fails the run

    @property
    def restarts(self) -> int:
        return sum(s.restarts for s in self._slots)

    async def sample(
        self, handle: SamplerHandle, prompt: Tokens, n: int, params: SamplingParams
    ) -> list[SampledTokens]:
        ray = import_ray()
        slot = await self._pick()
        generation = slot.restarts
        slot.outstanding += 1
        try:
            return await slot.actor.sample.remote(handle.version, prompt, n, params)
        except (ray.exceptions.RayActorError, ReplicaRestarted) as e:  # (Ray raises the latter as its cause's subclass)
            if slot.restarts == generation:
                self._down(slot, e)
            raise TransientBackendError(f"sampler replica {slot.index} died while sampling ({type(e).__name__})") from e
        finally:
            slot.outstanding -= 1

    async def _pick(self) -> _Slot:
        while True:
            live = [s for s in self._slots if s.live]
            if live:
                return min(live, key=lambda s: (s.outstanding, s.index))
            await until_one_is_back(self._live, "sampler replica")

    async def load_all(self, version: int, weights_ref: Any) -> float:
        """Every live replica holds ``version`` when this returns; the seconds it took."""
        ray = import_ray()
        started = time.perf_counter()
        self._weights[version] = weights_ref
        for old in [v for v in self._weights if v <= version - self._keep]:
            del self._weights[old]
        live = [(s, s.restarts) for s in self._slots if s.live or s.receiving]
        loads = (s.actor.load.remote(version, weights_ref) for s, _ in live)
        results = await asyncio.gather(*loads, return_exceptions=True)
        for (slot, generation), result in zip(live, results, strict=True):
            if isinstance(result, ray.exceptions.RayActorError | ReplicaRestarted):
                if slot.restarts == generation:
                    self._down(slot, result)  # it is given this version again when it comes back
            elif isinstance(result, BaseException):
                raise result
        self.last_publish_s = time.perf_counter() - started
        return self.last_publish_s

    def _down(self, slot: _Slot, error: BaseException) -> None:
        if not slot.live:
            return  # (a receiving one: its recovery sees the failure too, and starts over)
        slot.live = False
        slot.restarts += 1
        log.warning("sampler_replica_died", replica=slot.index, error=f"{type(error).__name__}: {error}"[:300])
        assert self._tasks is not None, "attach() the router to the backend's task group first"
        slot.recovering = self._tasks.create_task(self._recover(slot), name=f"replica-{slot.index}-restart")

    async def _recover(self, slot: _Slot) -> None:
        """Ray restarts the process; the backend is built again and given the versions in use."""
        ray = import_ray()
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while True:
            try:
                await slot.actor.start.remote(serving=False)
                slot.receiving = True  # from here each publish reaches it too
                for version, ref in sorted(self._weights.items()):
                    await slot.actor.load.remote(version, ref)
                await slot.actor.resume.remote()
                break
            except (ray.exceptions.ActorUnavailableError, ReplicaRestarted):  # still restarting, or died again
                slot.receiving = False
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        slot.live, slot.receiving = True, False
        self._live.set()
        log.info("sampler_replica_back", replica=slot.index, versions=sorted(self._weights))

    async def stop(self) -> None:
        for slot in self._slots:
            if slot.recovering is not None:
                slot.recovering.cancel()

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
from dataclasses import dataclass
from typing import Any

from headrace.core.errors import BackendError, ConfigError
from headrace.core.protocols import (
    Backend,
    BackendContext,
    InnerBackend,
    MovesWeights,
    TransientBackendError,
    max_context,
)
from headrace.core.types import SampledTokens, SamplerHandle, SamplingParams, Tokens
from headrace.plugins.backends import build_inner

from .restarts import Member, Members
from .runtime import import_ray


class ReplicaRestarted(BackendError, RuntimeError):
    """Raised by a replica Ray restarted between two requests, so none of them saw it die: it
    serves nothing until the router has started it again and given it back its versions."""


class SamplerReplica:
    """Runs in its own process (a Ray actor): the run's backend (its training backend, with its
    sampler if it names one), used for sampling only."""

    def __init__(
        self, training: InnerBackend, sampler: InnerBackend | None, ctx: BackendContext, index: int, keep: int
    ):
        self.training, self.sampler, self.ctx, self.index, self.keep = training, sampler, ctx, index, keep
        self._stack = contextlib.AsyncExitStack()
        self.backend: Any = None
        self.handles: dict[int, SamplerHandle] = {}
        self.serving = False

    async def start(self, serving: bool = True) -> dict[str, Any]:
        """Builds the backend; a restarted replica is started with ``serving=False`` and serves
        once ``resume`` says it holds every version in use again."""
        if self.backend is None:
            backend: Backend = build_inner(self.training, self.ctx)
            if self.sampler is not None:
                backend = build_inner(self.sampler, self.ctx, backend)
            if not isinstance(backend, MovesWeights):
                raise ConfigError(
                    f"--cluster ray moves each published version to the sampler replicas, and the "
                    f"'{self.sampler.name if self.sampler else self.training.name}' backend cannot take weights "
                    "published in another process (no weights_of / handle_for); run it in one process (--cluster none)."
                )
            self.backend = await self._stack.enter_async_context(backend)
            self.handles = {0: self.backend.initial_handle()}
        self.serving = serving
        return {"max_context": max_context(self.backend.sampling), "tokenizer": self.backend.tokenizer}

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


@dataclass(eq=False)
class _Slot(Member):
    outstanding: int = 0
    receiving: bool = False  # restarted, not serving yet, but given each publish


class ReplicaRouter:
    """The sampling side of the cluster backend: ``SamplingBackend`` over the replicas."""

    def __init__(self, actors: list[Any], max_context: int | None, keep: int):
        self._slots = [_Slot(i, a) for i, a in enumerate(actors)]
        self.replicas = Members("sampler_replica", self._slots, self._restore, restarting=(ReplicaRestarted,))
        self.max_context = max_context
        self._keep = keep
        self._weights: dict[int, Any] = {}  # version -> ObjectRef, the versions a restarted replica needs
        self.last_publish_s: float | None = None  # the last publish to every live replica

    @property
    def restarts(self) -> int:
        return self.replicas.restarts

    async def sample(
        self, handle: SamplerHandle, prompt: Tokens, n: int, params: SamplingParams
    ) -> list[SampledTokens]:
        ray = import_ray()
        slot = await self.replicas.pick(lambda s: (s.outstanding, s.index))
        generation = slot.restarts
        slot.outstanding += 1
        try:
            return await slot.actor.sample.remote(handle.version, prompt, n, params)
        except (ray.exceptions.RayActorError, ReplicaRestarted) as e:  # (Ray raises the latter as its cause's subclass)
            self.replicas.down(slot, generation, e)
            raise TransientBackendError(f"sampler replica {slot.index} died while sampling ({type(e).__name__})") from e
        finally:
            slot.outstanding -= 1

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
                # it is given this version again when it comes back (a receiving one: its restore
                # sees the failure too, and starts over)
                self.replicas.down(slot, generation, result)
            elif isinstance(result, BaseException):
                raise result
        self.last_publish_s = time.perf_counter() - started
        return self.last_publish_s

    async def _restore(self, slot: _Slot) -> None:
        """Ray restarted the process: its backend is built again and given the versions in use."""
        try:
            await slot.actor.start.remote(serving=False)
            slot.receiving = True  # from here each publish reaches it too
            for version, ref in sorted(self._weights.items()):
                await slot.actor.load.remote(version, ref)
            await slot.actor.resume.remote()
        finally:
            slot.receiving = False  # (then live, with no await between)

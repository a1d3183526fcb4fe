"""Which weights vLLM samples with: one LoRA adapter per policy version, or reloaded full weights.

The learner publishes a :class:`headrace.backends.torch.weights.PublishedWeights` snapshot per
version (``SamplerHandle.ref``); this module turns the versions that sample requests ask for
into engine state, through a small :class:`WeightTarget` (the in-process engine or a server):

- **LoRA**: version v is saved as a PEFT adapter directory and loaded as a new LoRA request
  with a new id, the first time a request asks for it. Requests name their version's adapter,
  so every sample is drawn from exactly the version its handle names, even while newer ones
  are loaded. An adapter is released (unloaded, its directory deleted) once no request uses it
  and a newer version of its chain is loaded (newer: ``SamplerHandle.order`` where set, so a
  version rolled back to is newer than the one it replaced; else the higher version). Handles
  of several chains (``SamplerHandle.scope``: ``headrace serve`` with ``serve.per_scenario``, one
  chain per scenario) are adapters side by side on one base model (vLLM multi-LoRA), each
  chain's versions released only by its own.
- **Full fine-tuning**: the engine holds one set of weights. A request for a newer version
  waits until the requests in flight on the current weights finish, then the weights are
  reloaded from a saved model directory (and the prefix cache reset); requests that arrive
  meanwhile wait for the reload (the reload is never starved). "Newer" is the handle's order
  where set (a version rolled back to is reloaded), else its version. A request whose handle is
  older than the engine's weights is served by the current weights: the sample records the version
  that was actually used.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Self

from headrace.core import logs
from headrace.core.sampler import ended_by_context
from headrace.core.types import SampledTokens, SamplerHandle, SamplingParams, Tokens

from .convert import request_n, room_for, stop_ids

log = logs.get_logger()

# LoRA ids are process-wide: two samplers sharing one engine (tests) must not collide.
_LORA_IDS = itertools.count(1)


class WeightTarget(Protocol):
    async def add_lora(self, name: str, lora_id: int, path: str) -> None: ...

    async def remove_lora(self, name: str, lora_id: int) -> None: ...

    async def reload_weights(self, path: str) -> None:
        """Replace the base weights in place with the model directory at ``path`` and drop
        every cached prefix computed with the old ones."""


@dataclass(frozen=True)
class Lease:
    """What one sample request uses: the version it samples from and, for LoRA, the adapter."""

    version: int
    lora_name: str | None = None
    lora_id: int | None = None
    lora_path: str | None = None


@dataclass(eq=False)
class _Adapter:
    version: int
    scope: str | None
    rank: int  # newer than another of its scope if higher: the handle's order, else its version
    name: str
    lora_id: int
    path: Path
    ready: asyncio.Future = field(repr=False)
    users: int = 0
    task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def loaded(self) -> bool:
        return self.ready.done() and not self.ready.cancelled() and self.ready.exception() is None


def weights_of(handle: SamplerHandle) -> Any:
    """The published snapshot behind a handle, checked: the vLLM sampler pairs with the torch learner."""
    ref = handle.ref
    if not (hasattr(ref, "save") and getattr(ref, "kind", None) in ("lora", "full")):
        raise TypeError(
            f"the vllm sampler needs weights published by the torch learner (SamplerHandle.ref with "
            f"kind 'lora' or 'full' and save(dir)); got ref={ref!r}. Use --backend torch with --sampler vllm."
        )
    return ref


class WeightVersions:
    """Enter it (``async with``) before leasing: adapter loads and weight reloads are tasks of a
    task group that lives as long as this object's context, so a bug in one fails the owner
    instead of being lost, and leaving the context cancels and awaits them."""

    def __init__(self, target: WeightTarget, workdir: Path, kind: str, initial_version: int = 0):
        if kind not in ("lora", "full"):
            raise ValueError(f"kind must be 'lora' or 'full', not {kind!r}")
        self.target = target
        self.workdir = Path(workdir)
        self.kind = kind
        self._tag = uuid.uuid4().hex[:8]  # adapter names stay unique on a shared server
        # LoRA: by (scope, version)
        self._adapters: dict[tuple[str | None, int], _Adapter] = {}
        # full fine-tuning
        self._current = initial_version  # the version the engine's base weights hold
        self._current_rank = initial_version  # and how new it is (_rank: a rollback is newer)
        self._wanted: SamplerHandle | None = None
        self._users = 0
        self._cond = asyncio.Condition()
        self._reload: asyncio.Future[None] | None = None  # the outcome of the reload in progress
        self._reload_task: asyncio.Task[None] | None = None
        self._stack = contextlib.AsyncExitStack()
        self._tasks: asyncio.TaskGroup | None = None
        # for tests and metrics
        self.history: list[int] = []  # versions in the order they were loaded into the engine
        self.loads = 0
        self.releases = 0
        self.reloads = 0
        self.handoffs: list[dict[str, Any]] = []  # per LoRA load: save (download, convert) and load times
        self.removed: list[tuple[str | None, int]] = []  # (scope, version) per adapter released

    async def __aenter__(self) -> Self:
        self._tasks = await self._stack.enter_async_context(asyncio.TaskGroup())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel the loads and the reload in progress and wait for them to end; raises what failed
        in them (not the exception the context was left with: the group would wrap it)."""
        for adapter in list(self._adapters.values()):
            if adapter.task is not None and not adapter.task.done():
                adapter.task.cancel()
        if self._reload_task is not None and not self._reload_task.done():
            self._reload_task.cancel()
        self._adapters.clear()
        await self._stack.aclose()

    def _spawn(self, work: Callable[[], Awaitable[None]], done: asyncio.Future[None], name: str) -> asyncio.Task[None]:
        """Run ``work`` in the task group, not in the request that needed it (a cancelled request
        must not leave a half-loaded adapter or half-reloaded weights behind). Its outcome goes to
        ``done``, which the requests await: a failed load fails them, not the sampler."""
        assert self._tasks is not None, "enter WeightVersions (async with) before leasing"

        async def run() -> None:
            try:
                await work()
            except Exception as e:
                done.set_exception(e)
                done.exception()  # marked as retrieved: the waiters raise it
            else:
                done.set_result(None)

        task = self._tasks.create_task(run(), name=name)
        task.add_done_callback(lambda _: done.cancel())  # cancelled, even before it ran: no waiter hangs
        return task

    @property
    def loaded_versions(self) -> list[int]:
        if self.kind == "full":
            return [self._current]
        return sorted(v for (_, v), a in self._adapters.items() if a.loaded)

    @property
    def loaded_adapters(self) -> list[tuple[str, int]]:
        """The LoRA adapters the engine holds now, as (scope or '', version)."""
        return sorted((s or "", v) for (s, v), a in self._adapters.items() if a.loaded)

    def handoff(self, version: int, scope: str | None = None) -> dict[str, Any] | None:
        """How the last load of that version reached the engine (times in s), None if never loaded."""
        for record in reversed(self.handoffs):
            if record["version"] == version and record.get("scope") == scope:
                return record
        return None

    @asynccontextmanager
    async def lease(self, handle: SamplerHandle) -> AsyncIterator[Lease]:
        weights_of(handle)
        if self.kind == "lora":
            async with self._lora_lease(handle) as lease:
                yield lease
        else:
            async with self._full_lease(handle) as lease:
                yield lease

    # ---- LoRA: one adapter per version ----

    @asynccontextmanager
    async def _lora_lease(self, handle: SamplerHandle) -> AsyncIterator[Lease]:
        adapter = self._adapters.get((handle.scope, handle.version))
        if adapter is None:
            adapter = self._start_load(handle)
        elif handle.order is not None:  # a rollback to a version still loaded: it is the newest now
            adapter.rank = max(adapter.rank, handle.order)
        adapter.users += 1
        try:
            await asyncio.shield(adapter.ready)
            yield Lease(handle.version, adapter.name, adapter.lora_id, str(adapter.path))
        finally:
            adapter.users -= 1
            await self._release_unused()

    def _start_load(self, handle: SamplerHandle) -> _Adapter:
        lora_id = next(_LORA_IDS)
        key = (handle.scope, handle.version)
        chain = "" if handle.scope is None else f"s.{handle.scope}-"  # a scope is a name of [A-Za-z0-9_-]
        name = f"headrace-{self._tag}-{chain}v{handle.version}"
        path = self.workdir / f"lora-{chain}v{handle.version}-{lora_id}"
        loop = asyncio.get_running_loop()
        rank = _rank(handle)
        adapter = _Adapter(handle.version, handle.scope, rank, name, lora_id, path, loop.create_future())
        self._adapters[key] = adapter

        async def load() -> None:
            weights = weights_of(handle)
            try:
                started = time.perf_counter()
                await asyncio.to_thread(weights.save, path)
                saved = time.perf_counter()
                await self.target.add_lora(name, lora_id, str(path))
            except BaseException:
                if self._adapters.get(key) is adapter:
                    del self._adapters[key]  # the next request tries again
                shutil.rmtree(path, ignore_errors=True)
                raise
            self.loads += 1
            self.history.append(handle.version)
            # a hosted learner's weights say how they came down (download and convert times)
            came: dict[str, Any] = dict(getattr(weights, "handoff", None) or {})
            handoff = came | {
                "version": handle.version, "scope": handle.scope, "save_s": round(saved - started, 4),
                "load_s": round(time.perf_counter() - saved, 4),
            }  # fmt: skip
            self.handoffs.append(handoff)
            log.info("vllm_lora_loaded", **handoff)

        adapter.task = self._spawn(load, adapter.ready, name=f"vllm-load-lora-v{handle.version}")
        return adapter

    async def _release_unused(self) -> None:
        ready = [(key, a.rank) for key, a in self._adapters.items() if a.loaded]
        newest: dict[str | None, int] = {}
        for (scope, _), rank in ready:
            newest[scope] = max(rank, newest.get(scope, rank))
        for key, rank in ready:
            adapter = self._adapters.get(key)
            if adapter is not None and rank < newest[key[0]] and adapter.users == 0:
                del self._adapters[key]
                try:
                    await self.target.remove_lora(adapter.name, adapter.lora_id)
                finally:
                    shutil.rmtree(adapter.path, ignore_errors=True)
                self.releases += 1
                self.removed.append(key)
                log.info("vllm_lora_released", version=key[1], scope=key[0])

    # ---- full fine-tuning: one set of weights, reloaded per version ----

    @asynccontextmanager
    async def _full_lease(self, handle: SamplerHandle) -> AsyncIterator[Lease]:
        async with self._cond:
            if _rank(handle) > self._current_rank and (self._wanted is None or _rank(handle) > _rank(self._wanted)):
                self._wanted = handle
            while True:
                if self._reload is not None:
                    reload = self._reload
                    self._cond.release()
                    try:
                        await asyncio.shield(reload)
                    finally:
                        await self._cond.acquire()
                    continue
                if self._wanted is not None and _rank(self._wanted) > self._current_rank:
                    if self._users == 0:
                        wanted, self._reload = self._wanted, asyncio.get_running_loop().create_future()
                        self._reload_task = self._spawn(
                            functools.partial(self._do_reload, wanted),
                            self._reload,
                            name=f"vllm-reload-v{wanted.version}",
                        )
                    else:
                        await self._cond.wait()  # writer preference: wait for the readers to leave
                    continue
                break
            self._users += 1
            version = self._current
        try:
            yield Lease(version)
        finally:
            async with self._cond:
                self._users -= 1
                self._cond.notify_all()

    async def _do_reload(self, handle: SamplerHandle) -> None:
        path = self.workdir / f"full-v{handle.version}"
        try:
            await asyncio.to_thread(weights_of(handle).save, path)
            await self.target.reload_weights(str(path))
            self._current, self._current_rank = handle.version, _rank(handle)
            self.reloads += 1
            self.history.append(handle.version)
        finally:
            shutil.rmtree(path, ignore_errors=True)
            async with self._cond:
                self._reload = None
                if self._wanted is handle and self._current_rank != _rank(handle):
                    self._wanted = None  # failed: the next request for it tries again
                self._cond.notify_all()


def _rank(handle: SamplerHandle) -> int:
    """How new a handle is among its scope's: its order where set (a serve rollback), else its version."""
    return handle.version if handle.order is None else handle.order


class LeasedSampler:
    """What the engine and the server samplers share (``SamplingBackend``): the request checks, and
    each request drawn from, and its samples stamped with, the version its lease names. A
    subclass sends the request (``_draw``), with the request's seed only if ``seed_requests``
    (``vllm.seed_requests``)."""

    source = "vLLM"  # who answered, for errors

    def __init__(
        self, versions: WeightVersions, model_stops: Iterable[int], max_model_len: int, *, seed_requests: bool = False
    ):
        self.versions = versions
        self.model_stops = tuple(model_stops)
        self.max_model_len = max_model_len
        self.seed_requests = seed_requests
        self.requests = 0

    async def sample(
        self, handle: SamplerHandle, prompt: Tokens, n: int, params: SamplingParams
    ) -> list[SampledTokens]:
        if n <= 0:
            return []
        if not prompt:
            raise ValueError("cannot sample from an empty prompt")
        max_tokens = room_for(prompt, params.max_tokens, self.max_model_len)
        asked = request_n(params, n)
        self.requests += 1
        async with self.versions.lease(handle) as lease:
            samples = await self._draw(lease, prompt, params, asked, max_tokens, stop_ids(params, self.model_stops))
        if len(samples) != asked:
            raise RuntimeError(f"{self.source} returned {len(samples)} samples for a request of n={asked}")
        if max_tokens < params.max_tokens:  # cut to fit vllm.max_model_len
            samples = ended_by_context(samples)
        return [dataclasses.replace(s, policy_version=lease.version) for s in samples] * (n // asked)

    async def _draw(
        self, lease: Lease, prompt: Tokens, params: SamplingParams, n: int, max_tokens: int, stops: list[int]
    ) -> list[SampledTokens]:
        """The samples of one request for ``n`` from the weights ``lease`` names, in index order."""
        raise NotImplementedError

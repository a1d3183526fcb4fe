"""Which weights vLLM samples with: one LoRA adapter per policy version, or reloaded full weights.

The learner publishes a :class:`headrace.backends.torch.weights.PublishedWeights` snapshot per
version (``SamplerHandle.ref``); this module turns the versions that sample requests ask for
into engine state, through a small :class:`WeightTarget` (the in-process engine or a server):

- **LoRA**: version v is saved as a PEFT adapter directory and loaded as a new LoRA request
  with a new id, the first time a request asks for it. Requests name their version's adapter,
  so every sample is drawn from exactly the version its handle names, even while newer ones
  are loaded. An adapter is released (unloaded, its directory deleted) once no request uses it
  and a newer version is loaded.
- **Full fine-tuning**: the engine holds one set of weights. A request for a newer version
  waits until the requests in flight on the current weights finish, then the weights are
  reloaded from a saved model directory (and the prefix cache reset); requests that arrive
  meanwhile wait for the reload (the reload is never starved). A request whose handle is older
  than the engine's weights is served by the current weights: the sample records the version
  that was actually used.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from headrace.engine.types import SamplerHandle

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
    def __init__(self, target: WeightTarget, workdir: Path, kind: str, initial_version: int = 0):
        if kind not in ("lora", "full"):
            raise ValueError(f"kind must be 'lora' or 'full', not {kind!r}")
        self.target = target
        self.workdir = Path(workdir)
        self.kind = kind
        self._tag = uuid.uuid4().hex[:8]  # adapter names stay unique on a shared server
        # LoRA
        self._adapters: dict[int, _Adapter] = {}
        # full fine-tuning
        self._current = initial_version  # the version the engine's base weights hold
        self._wanted: SamplerHandle | None = None
        self._users = 0
        self._cond = asyncio.Condition()
        self._reload: asyncio.Task | None = None
        # for tests and metrics
        self.history: list[int] = []  # versions in the order they were loaded into the engine
        self.loads = 0
        self.releases = 0
        self.reloads = 0

    @property
    def loaded_versions(self) -> list[int]:
        if self.kind == "full":
            return [self._current]
        return sorted(v for v, a in self._adapters.items() if a.loaded)

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
        adapter = self._adapters.get(handle.version)
        if adapter is None:
            adapter = self._start_load(handle)
        adapter.users += 1
        try:
            await asyncio.shield(adapter.ready)
            yield Lease(handle.version, adapter.name, adapter.lora_id, str(adapter.path))
        finally:
            adapter.users -= 1
            await self._release_unused()

    def _start_load(self, handle: SamplerHandle) -> _Adapter:
        lora_id = next(_LORA_IDS)
        name = f"headrace-{self._tag}-v{handle.version}"
        path = self.workdir / f"lora-v{handle.version}-{lora_id}"
        loop = asyncio.get_running_loop()
        adapter = _Adapter(handle.version, name, lora_id, path, loop.create_future())
        self._adapters[handle.version] = adapter

        async def load() -> None:
            try:
                await asyncio.to_thread(weights_of(handle).save, path)
                await self.target.add_lora(name, lora_id, str(path))
                self.loads += 1
                self.history.append(handle.version)
            except BaseException as e:
                if self._adapters.get(handle.version) is adapter:
                    del self._adapters[handle.version]  # the next request tries again
                shutil.rmtree(path, ignore_errors=True)
                if isinstance(e, Exception):
                    adapter.ready.set_exception(e)
                    adapter.ready.exception()  # marked as retrieved: the waiters raise it
                else:
                    adapter.ready.cancel()
                    raise
            else:
                adapter.ready.set_result(None)

        # a task of its own: a cancelled request must not leave a half-loaded adapter behind
        adapter.task = loop.create_task(load(), name=f"vllm-load-lora-v{handle.version}")
        return adapter

    async def _release_unused(self) -> None:
        ready = [v for v, a in self._adapters.items() if a.loaded]
        if not ready:
            return
        newest = max(ready)
        for version in ready:
            adapter = self._adapters.get(version)
            if adapter is not None and version < newest and adapter.users == 0:
                del self._adapters[version]
                try:
                    await self.target.remove_lora(adapter.name, adapter.lora_id)
                finally:
                    shutil.rmtree(adapter.path, ignore_errors=True)
                self.releases += 1

    # ---- full fine-tuning: one set of weights, reloaded per version ----

    @asynccontextmanager
    async def _full_lease(self, handle: SamplerHandle) -> AsyncIterator[Lease]:
        async with self._cond:
            if handle.version > self._current and (self._wanted is None or handle.version > self._wanted.version):
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
                if self._wanted is not None and self._wanted.version > self._current:
                    if self._users == 0:
                        self._reload = asyncio.get_running_loop().create_task(self._do_reload(self._wanted))
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
            self._current = handle.version
            self.reloads += 1
            self.history.append(handle.version)
        finally:
            shutil.rmtree(path, ignore_errors=True)
            async with self._cond:
                self._reload = None
                if self._wanted is handle and self._current != handle.version:
                    self._wanted = None  # failed: the next request for it tries again
                self._cond.notify_all()

    async def close(self) -> None:
        for adapter in list(self._adapters.values()):
            if adapter.task is not None and not adapter.task.done():
                adapter.task.cancel()
        if self._reload is not None and not self._reload.done():
            self._reload.cancel()
        self._adapters.clear()

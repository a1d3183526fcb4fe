"""The sampling backend: coalesces concurrent ``sample`` calls into batches on the device thread.

A request waits at most ``sample_batch_wait_s`` for company; then one device job is queued.
That job takes every request pending *when it starts*, so requests that arrive while the
device is busy training join the next batch instead of queueing as many small ones. Batches
hold at most ``max_sample_batch`` sequences and one weights version each.

Versions: the sampler module shares the trainer's frozen weights and points its trainable
parameters at the snapshot carried by the request's handle (``weights.PublishedWeights``), so
a request issued with version v is sampled with exactly v's weights, even after newer
versions are published. Switching versions copies nothing.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import random
import threading
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

import torch
from torch import nn

from headrace.core.types import SampledTokens, SamplerHandle, SamplingParams, Tokens

from .device_thread import DeviceThread
from .generate import Generator, Row
from .weights import PublishedWeights, point_at


@dataclass(eq=False)
class _Request:
    handle: SamplerHandle
    prompt: list[int]
    n: int
    params: SamplingParams
    seed: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    generator: torch.Generator | None = None  # made on the device thread, kept across chunks
    results: list[SampledTokens] = field(default_factory=list)


class SamplerModel:
    """A second module over the same base weights whose trainable tensors follow a version."""

    def __init__(self, trainer_model: nn.Module, trainable_names: set[str], initial: PublishedWeights):
        memo: dict[int, Any] = {}
        for name, p in trainer_model.named_parameters():
            if name in trainable_names:
                # start directly on the initial snapshot instead of copying the trainer's tensor
                memo[id(p)] = nn.Parameter(initial.tensors[name], requires_grad=False)
            else:
                memo[id(p)] = p  # frozen base weights are shared, not copied
        self.module = copy.deepcopy(trainer_model, memo)
        self.module.eval()
        self.params = {n: p for n, p in self.module.named_parameters() if n in trainable_names}
        self.current: PublishedWeights = initial
        get_base_model = getattr(self.module, "get_base_model", None)  # PEFT injects LoRA into the base model's layers
        self.forward_module = get_base_model() if get_base_model is not None else self.module

    def use(self, weights: PublishedWeights) -> None:
        if weights is not self.current:
            point_at(self.params, weights.tensors)
            self.current = weights  # the previous snapshot is freed once no handle holds it


class TorchSampler:
    def __init__(
        self,
        model: SamplerModel,
        device_thread: DeviceThread,
        device: torch.device,
        pad_token_id: int,
        stop_token_ids: tuple[int, ...],
        batch_wait_s: float,
        max_batch: int,
        seed: int,
    ):
        self._model = model
        self._generator = Generator(model.forward_module, pad_token_id, device)
        self._device_thread = device_thread
        self._device = device
        self._stops = frozenset(stop_token_ids)
        self._wait_s = batch_wait_s
        self._max_batch = max_batch
        self.seed = seed
        self.unseeded_requests = 0  # requests without a seed get (run seed, this count): saved in checkpoints
        self._lock = threading.Lock()
        self._pending: list[_Request] = []
        self._job_queued = False
        self._timer: asyncio.TimerHandle | None = None
        self.batches = 0
        self.rows = 0
        # read by the engine, which checks prompts and caps max_tokens before calling sample()
        config = getattr(model.forward_module, "config", None)
        self.max_context: int | None = getattr(config, "max_position_embeddings", None)

    async def sample(
        self, handle: SamplerHandle, prompt: Tokens, n: int, params: SamplingParams
    ) -> list[SampledTokens]:
        if not isinstance(handle.ref, PublishedWeights):
            raise TypeError(f"the torch sampler needs a handle published by the torch learner, got ref={handle.ref!r}")
        if n <= 0:
            return []
        if not prompt:
            raise ValueError("cannot sample from an empty prompt")
        if self.max_context is not None:
            room = self.max_context - len(prompt)
            if room < 1:
                raise ValueError(f"a prompt of {len(prompt)} tokens leaves no room in a context of {self.max_context}")
            if params.max_tokens > room:
                params = dataclasses.replace(params, max_tokens=room)
        loop = asyncio.get_running_loop()
        seed = params.seed
        if seed is None:
            seed = random.Random(f"{self.seed}/{self.unseeded_requests}").getrandbits(63)
            self.unseeded_requests += 1
        request = _Request(handle, list(prompt), n, params, seed, loop.create_future(), loop)
        with self._lock:
            self._pending.append(request)
            rows = sum(r.n for r in self._pending)
        if rows >= self._max_batch or self._wait_s <= 0:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self._wait_s, self._flush)
        return await request.future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        with self._lock:
            if self._job_queued or not self._pending:
                return  # a queued job will take what is pending when it starts
            self._job_queued = True
        try:
            self._device_thread.submit_threadsafe(self._run)
        except RuntimeError as e:  # the backend was closed with requests still waiting
            with self._lock:
                requests, self._pending, self._job_queued = self._pending, [], False
            for request in requests:
                _resolve(request, exc=e)

    # ---- device thread ----

    def _run(self) -> None:
        with self._lock:
            requests, self._pending = self._pending, []
            self._job_queued = False
        live = [r for r in requests if not r.future.cancelled()]
        # one version per batch; sorting keeps the order of requests within a version
        live.sort(key=lambda r: r.handle.version)
        for _, same_version in groupby(live, key=lambda r: r.handle.version):
            for chunk in self._chunks(list(same_version)):
                self._run_chunk(chunk)

    def _chunks(self, requests: list[_Request]):
        """Lists of (request, rows of it) with at most max_batch rows in all; a request larger
        than the room left is split, its generator carrying on from one chunk to the next."""
        chunk, size = [], 0
        for r in requests:
            left = r.n
            while left:
                take = min(left, self._max_batch - size)
                chunk.append((r, take))
                size, left = size + take, left - take
                if size == self._max_batch:
                    yield chunk
                    chunk, size = [], 0
        if chunk:
            yield chunk

    def _run_chunk(self, chunk: list[tuple[_Request, int]]) -> None:
        try:
            self._model.use(chunk[0][0].handle.ref)
            rows: list[Row] = []
            for request, take in chunk:
                if request.generator is None:
                    request.generator = torch.Generator(device=self._device).manual_seed(request.seed)
                p = request.params
                stops = self._stops | frozenset(p.stop_token_ids)
                row = Row(request.prompt, p.max_tokens, p.temperature, p.top_p, p.top_k, stops, request.generator)
                rows += [row] * take
            results = self._generator.generate(rows)
            self.batches += 1
            self.rows += len(rows)
        except BaseException as e:  # noqa: BLE001 - the error belongs to the requests, not the thread
            for request, _ in chunk:
                _resolve(request, exc=e)
            return
        start = 0
        for request, take in chunk:
            mine = results[start : start + take]
            request.results += [SampledTokens(r.tokens, r.logprobs, r.stop_reason) for r in mine]
            start += take
            if len(request.results) == request.n:
                _resolve(request, value=request.results)


def _resolve(request: _Request, value: Any = None, exc: BaseException | None = None) -> None:
    def settle() -> None:
        if request.future.done():  # cancelled meanwhile: nobody is waiting
            return
        if exc is not None:
            request.future.set_exception(exc)
        else:
            request.future.set_result(value)

    try:
        request.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: the run is over
        pass

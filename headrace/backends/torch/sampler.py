"""The sampling backend: coalesces concurrent ``sample`` calls into batches on the device thread.

Which requests share a batch (``batching``) decides what each computes: a row's logits differ in
their last bits with the rows beside it (a matmul over 3 rows is not summed as one over 64; the
padding to a longer prompt shifts the attention's blocks), and a sampled token can follow them.

- ``"window"`` (the default; serving, ``async``, ``inflight``): a request waits at most
  ``sample_batch_wait_s`` for company; then one device job is queued. That job takes every
  request pending *when it starts*, so requests that arrive while the device is busy training
  join the next batch instead of queueing as many small ones. Fast, and timing decides the batches.
- ``"settled"`` (``batch_reproducibly()``, which the engine calls for ``sync`` and ``stream``): a
  job is the requests pending once the event loop has nothing else to run (``core/settle.py``),
  exactly those, however many batches they fill; its answers reach the loop in one callback at
  its end, so the rollouts they wake all run before the next job forms. The same code gives the
  same batches, so a seeded run repeats itself.
- ``"alone"`` (the Tinker emulator, whose requests come over the network at times nobody
  controls): each request is its own batch, so a seeded request's tokens never depend on what
  else was being sampled.

Batches hold at most ``max_sample_batch`` sequences and one weights version each.

Versions: the sampler module shares the trainer's frozen weights and points its trainable
parameters at the snapshot carried by the request's handle (``weights.PublishedWeights``), so
a request issued with version v is sampled with exactly v's weights, even after newer
versions are published. Switching versions copies nothing.

In-flight swaps (``inflight_swap``, for the ``inflight`` scheduler): once ``swap_weights`` has
been called, a batch is decoded ``slice_steps`` tokens per device job and then queued again
behind whatever was submitted meanwhile, so the learner's steps run between decode steps instead
of after the whole generation. Before each slice, a batch whose requests follow the current
weights takes the newest version swapped in (``Generation.reweigh``: the KV cache recomputed,
``swap_mode = "recompute"``, or kept, ``"keep"``); every token is stamped with the version that
drew it (``SampledTokens.token_versions``). A request follows the current weights when it was
issued with them (its handle is not older than the newest swap): an evaluation that pins an
older version keeps it to the end. A request with several batches (more rows than
``max_sample_batch``) may see a swap land at different steps in each of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import groupby
from typing import TypeVar

import torch
from torch import nn

from headrace.core.settle import call_when_settled
from headrace.core.types import SampledTokens, SamplerHandle, SamplingParams, Tokens

from .device_thread import Answers, DeviceThread
from .flops import PerfMeter
from .generate import SWAP_MODES, Generation, Generator, Row, RowResult
from .weights import PublishedWeights, SamplerModel

T = TypeVar("T")
BATCHING = ("window", "settled", "alone")


@dataclass(eq=False)
class _Request:
    handle: SamplerHandle
    prompt: list[int]
    n: int
    params: SamplingParams
    seed: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    follows: bool = True  # takes weights swapped in while it runs (issued with the current ones)
    generator: torch.Generator | None = None  # made on the device thread, kept across chunks
    results: dict[int, list[SampledTokens]] = field(default_factory=dict)  # by the chunk's first row

    def settled(self) -> bool:
        return sum(len(r) for r in self.results.values()) == self.n


@dataclass(eq=False)
class _Batch:
    """One chunk of rows being generated with one version at a time."""

    chunk: list[tuple[_Request, int, int]]  # (request, its first row here, rows)
    weights: PublishedWeights
    generation: Generation
    follows: bool

    def abandoned(self) -> bool:
        return all(r.future.cancelled() or r.future.done() for r, _, _ in self.chunk)


# decode steps per device job once in-flight swaps are on: the learner waits at most this many
# steps of every running batch for the device (see benchmarks/RESULTS.md, "In-flight updates")
SLICE_STEPS = 4


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
        swap_mode: str = "recompute",
        slice_steps: int = SLICE_STEPS,
        meter: PerfMeter | None = None,
    ):
        if swap_mode not in SWAP_MODES:
            raise ValueError(f"unknown swap mode {swap_mode!r}; use one of {', '.join(SWAP_MODES)}")
        self._model = model
        self.meter = meter  # device seconds of its jobs, tokens sampled (FLOPs: the generator's)
        self._generator = Generator(model.forward_module, pad_token_id, device, meter)
        self._device_thread = device_thread
        self._device = device
        self._stops = frozenset(stop_token_ids)
        self._wait_s = batch_wait_s
        self._max_batch = max_batch
        self.seed = seed
        self.unseeded_requests = 0  # requests without a seed get (run seed, this count): saved in checkpoints
        self.batching = "window"  # see the module docstring
        self._lock = threading.Lock()
        self._pending: list[_Request] = []
        self._job_queued = False
        self._timer: asyncio.TimerHandle | None = None
        self._settling = False  # "settled": a flush waits for the loop to settle
        self.batches = 0
        self.rows = 0
        # read by the engine, which checks prompts and caps max_tokens before calling sample()
        config = getattr(model.forward_module, "config", None)
        self.max_context: int | None = getattr(config, "max_position_embeddings", None)
        # in-flight swaps (see the module docstring)
        self.inflight_swap = True
        self.swap_mode = swap_mode
        self.slice_steps = slice_steps
        self._live: SamplerHandle | None = None  # newest weights swapped in; None: swap mode unused
        self._active: list[_Batch] = []  # device thread only
        self._slice_queued = False
        # (version, batch rows, decode steps done before it, seconds) per swap into a running batch
        self.swaps: deque[tuple[int, int, int, float]] = deque(maxlen=10_000)

    def batch_reproducibly(self) -> None:
        """Batches formed by the run's code, not by timing (``"settled"``; the engine's hook for
        sync runs, see ``core/protocols.py``)."""
        self.batching = "settled"

    async def forward(self, handle: SamplerHandle, fn: Callable[[nn.Module], T]) -> T:
        """``fn(module)`` on the device thread, with the weights behind ``handle`` in place: a
        forward pass that is not a generation (the Tinker emulator's prompt logprobs)."""
        if not isinstance(handle.ref, PublishedWeights):
            raise TypeError(f"the torch sampler needs a handle published by the torch learner, got ref={handle.ref!r}")

        def run() -> T:
            self._model.use(handle.ref)
            with torch.no_grad():
                return fn(self._model.forward_module)

        return await self._device_thread.submit(run)

    async def topk_logprobs(self, handle: SamplerHandle, tokens: Tokens, k: int) -> list[list[tuple[int, float]]]:
        """Each position's ``k`` likeliest next tokens and their logprobs, from a forward of the
        weights behind ``handle`` (``ScoresTopK``): entry t is the distribution of token t given
        the tokens before it (entry 0 is empty)."""

        def top(module: nn.Module) -> list[list[tuple[int, float]]]:
            ids = torch.tensor([list(tokens)], dtype=torch.long, device=self._device)
            logp = module(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
            values, indices = logp.topk(min(k, logp.shape[-1]), dim=-1)
            rows = [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
            return [[], *rows]

        return await self.forward(handle, top)

    def swap_weights(self, handle: SamplerHandle) -> None:
        """Newer weights for every generation that follows the current ones, running ones included
        (from their next decode step). The first call turns sliced decoding on."""
        if not isinstance(handle.ref, PublishedWeights):
            raise TypeError(f"the torch sampler needs a handle published by the torch learner, got ref={handle.ref!r}")
        with self._lock:
            if self._live is None or handle.version > self._live.version:
                self._live = handle

    async def sample(
        self, handle: SamplerHandle, prompt: Tokens, n: int, params: SamplingParams
    ) -> list[SampledTokens]:
        if not isinstance(handle.ref, PublishedWeights):
            raise TypeError(f"the torch sampler needs a handle published by the torch learner, got ref={handle.ref!r}")
        if self.batching not in BATCHING:
            raise ValueError(f"unknown batching {self.batching!r}; use one of {', '.join(BATCHING)}")
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
            request.follows = self._live is None or handle.version >= self._live.version
            self._pending.append(request)
            rows = sum(r.n for r in self._pending)
        if self.batching == "window":
            if rows >= self._max_batch or self._wait_s <= 0:
                self._flush()
            elif self._timer is None:
                self._timer = loop.call_later(self._wait_s, self._flush)
        elif self.batching == "alone":
            self._send_pending()
        elif not self._settling:  # however many rows: one job, answered at once, keeps the rounds apart
            self._settling = True
            call_when_settled(self._settled)
        return await request.future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        with self._lock:
            if self._job_queued or not self._pending:
                return  # a queued job will take what is pending when it starts
            self._job_queued = True
        self._submit(self._run_pending, [])

    def _settled(self) -> None:
        self._settling = False
        self._send_pending()

    def _send_pending(self) -> None:
        """One device job for exactly the requests pending now (``"settled"``, ``"alone"``)."""
        with self._lock:
            requests, self._pending = self._pending, []
        if requests:
            self._submit(functools.partial(self._run, requests, True), requests)

    def _submit(self, job: Callable[[], None], taken: list[_Request]) -> None:
        """Queue ``job`` on the device thread (``taken``: the requests it was given, if any)."""
        try:
            self._device_thread.submit_threadsafe(self._timed(job))
        except RuntimeError as e:  # the backend was closed with requests still waiting
            with self._lock:
                pending, self._pending, self._job_queued = self._pending, [], False
            answers = Answers()
            for request in [*taken, *pending]:
                answers.fail(request.loop, request.future, e)
            answers.send()

    # ---- device thread ----

    def _timed(self, job: Callable[[], None]) -> Callable[[], None]:
        return job if self.meter is None else self.meter.timed("sample", job)

    def _run_pending(self) -> None:
        with self._lock:
            requests, self._pending = self._pending, []
            self._job_queued = False
        self._run(requests, False)

    def _run(self, requests: list[_Request], together: bool) -> None:
        """Sample ``requests``; ``together``: their answers reach the loop at once, at the end
        (else each batch's as it ends)."""
        with self._lock:
            live = self._live
        requests = [r for r in requests if not r.future.cancelled()]

        def weights(r: _Request) -> SamplerHandle:
            # a request that follows the current weights starts with the newest ones
            return live if r.follows and live is not None and live.version > r.handle.version else r.handle

        # one version per batch; sorting keeps the order of requests within a version
        requests.sort(key=lambda r: (weights(r).version, not r.follows))
        answers = Answers()
        batches = []
        for (_, follows), same in groupby(requests, key=lambda r: (weights(r).version, r.follows)):
            same_version = list(same)
            handle = weights(same_version[0])
            for chunk in self._chunks(same_version):
                batch = self._start(chunk, handle, follows, answers)
                if batch is not None:
                    batches.append(batch)
        if live is None:  # no in-flight swaps: each batch runs to its end in this job
            for batch in batches:
                self._advance(batch, None, answers)
                if not together:
                    answers.send()
            answers.send()
            return
        answers.send()
        self._active += batches
        self._slice()

    def _chunks(self, requests: list[_Request]):
        """Lists of (request, its first row, rows) with at most max_batch rows in all; a request
        larger than the room left is split, its generator carrying on from one chunk to the next."""
        chunk, size = [], 0
        for r in requests:
            done = 0
            while done < r.n:
                take = min(r.n - done, self._max_batch - size)
                chunk.append((r, done, take))
                size, done = size + take, done + take
                if size == self._max_batch:
                    yield chunk
                    chunk, size = [], 0
        if chunk:
            yield chunk

    def _start(
        self, chunk: list[tuple[_Request, int, int]], handle: SamplerHandle, follows: bool, answers: Answers
    ) -> _Batch | None:
        try:
            return _Batch(chunk, handle.ref, self._generation(chunk, handle), follows)
        except BaseException as e:  # noqa: BLE001 - the error belongs to the requests, not the thread
            error = e
        # one request's parameters (a seed or a top_k no tensor holds) must not fail the others:
        # each is tried alone, those at fault get their own error, the rest are batched again
        fine = [item for item in chunk if self._fine_alone(item, handle, answers)]
        if fine and len(fine) < len(chunk):
            return self._start(fine, handle, follows, answers)
        for request, _, _ in fine:  # none is at fault alone: the batch's error is theirs
            answers.fail(request.loop, request.future, error)
        return None

    def _fine_alone(self, item: tuple[_Request, int, int], handle: SamplerHandle, answers: Answers) -> bool:
        try:
            self._generation([item], handle)
        except BaseException as e:  # noqa: BLE001 - as above
            answers.fail(item[0].loop, item[0].future, e)
            return False
        return True

    def _generation(self, chunk: list[tuple[_Request, int, int]], handle: SamplerHandle) -> Generation:
        rows: list[Row] = []
        for request, _, take in chunk:
            if request.generator is None:
                request.generator = torch.Generator(device=self._device).manual_seed(request.seed)
            p = request.params
            stops = self._stops | frozenset(p.stop_token_ids)
            row = Row(request.prompt, p.max_tokens, p.temperature, p.top_p, p.top_k, stops, request.generator)
            rows += [row] * take
        return Generation(self._generator, rows, handle.version)

    def _advance(self, batch: _Batch, steps: int | None, answers: Answers) -> bool:
        """Decode up to ``steps`` tokens of the batch; True once it is over (done or failed).
        A request whose rows have all ended is answered then, without waiting for the batch."""
        generation = batch.generation
        try:
            self._model.use(batch.weights)
            done = generation.advance(steps)
            ended = [True] * len(generation.rows) if done else generation.finished()
            at, answered = 0, []
            for request, first, take in batch.chunk:
                if first not in request.results and all(ended[at : at + take]):
                    answered.append((request, first, generation.results(range(at, at + take))))
                at += take
            if done:
                self.batches += 1
                self.rows += len(generation.rows)
        except BaseException as e:  # noqa: BLE001 - the error belongs to the requests, not the thread
            for request, _, _ in batch.chunk:
                answers.fail(request.loop, request.future, e)
            return True
        for request, first, results in answered:
            request.results[first] = [_sampled(r) for r in results]
            if self.meter is not None:
                self.meter.add("decode", tokens=sum(len(r.tokens) for r in results))
            if request.settled():
                answers.give(
                    request.loop, request.future, [s for k in sorted(request.results) for s in request.results[k]]
                )
        return done

    def _slice(self) -> None:
        """``slice_steps`` more tokens of every running batch, each taking the newest weights
        first if it follows them; then queued again, behind the learner's work, if any is left."""
        with self._lock:
            live = self._live
        answers = Answers()
        for batch in list(self._active):
            if batch.abandoned():
                self._active.remove(batch)
                continue
            if batch.follows and live is not None and live.version > batch.generation.version:
                if not self._swap(batch, live, answers):
                    self._active.remove(batch)
                    continue
            if self._advance(batch, self.slice_steps, answers):
                self._active.remove(batch)
            answers.send()  # at once: the learner's next step may land before this batch's next slice
        if self._active and not self._slice_queued:
            self._slice_queued = True
            try:
                self._device_thread.submit_threadsafe(self._timed(self._slice_job))
            except RuntimeError as e:  # the backend is shutting down under running generations
                self._slice_queued = False
                for batch in self._active:
                    for request, _, _ in batch.chunk:
                        answers.fail(request.loop, request.future, e)
                self._active.clear()
        answers.send()

    def _slice_job(self) -> None:
        self._slice_queued = False  # _run slices too, without taking this job's place in the queue
        self._slice()

    def _swap(self, batch: _Batch, live: SamplerHandle, answers: Answers) -> bool:
        generation = batch.generation
        try:
            begun = time.perf_counter()
            self._model.use(live.ref)
            if generation.reweigh(live.version, self.swap_mode):  # else it starts with them
                if self._device.type == "cuda":
                    torch.cuda.synchronize(self._device)  # the swap's own time, not the next step's
                self.swaps.append((live.version, len(generation.rows), generation.step, time.perf_counter() - begun))
        except BaseException as e:  # noqa: BLE001 - the error belongs to the requests, not the thread
            for request, _, _ in batch.chunk:
                answers.fail(request.loop, request.future, e)
            return False
        batch.weights = live.ref
        return True


def _sampled(row: RowResult) -> SampledTokens:
    versions = row.versions
    if not versions:
        return SampledTokens(row.tokens, row.logprobs, row.stop_reason)
    per_token = versions if versions[0] != versions[-1] else None  # versions only ever grow
    return SampledTokens(row.tokens, row.logprobs, row.stop_reason, versions[0], per_token)

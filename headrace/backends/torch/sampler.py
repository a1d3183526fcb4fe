"""The sampling backend: the API the event loop calls, and how concurrent ``sample`` calls become
device jobs. The device side (the batches being decoded, joins, swaps, answers) is
``running.py``; one batch's KV cache and decode steps are ``generate.py``.

Which requests share a batch (``batching``) decides what each computes: a row's logits differ in
their last bits with the rows beside it (a matmul over 3 rows is not summed as one over 64; the
padding to a longer prompt shifts the attention's blocks), and a sampled token can follow them.

- ``"window"`` (the default; serving, ``async``, ``inflight``): continuous batching. While the
  decode loop runs, a new request joins the running batch of its weights before the next decode
  step (``running.py``), so the sampler never waits for a batch to drain; when the loop is idle,
  a request waits at most ``sample_batch_wait_s`` for company, and the loop starts. The loop runs
  ``slice_steps`` decode steps per device job and is then queued again behind whatever was
  submitted meanwhile, so the learner's work runs between decode steps. Fast, and timing decides
  the batches.
- ``"settled"`` (``batch_reproducibly()``, which the engine calls for ``sync`` and ``stream``): a
  job is the requests pending once the event loop has nothing else to run (``core/settle.py``),
  exactly those, however many batches they fill, each batch closed to joiners; its answers reach
  the loop in one callback at its end, so the rollouts they wake all run before the next job
  forms. The same code gives the same batches, so a seeded run repeats itself.
- ``"alone"`` (the Tinker emulator, whose requests come over the network at times nobody
  controls): each request is its own batch, so a seeded request's tokens never depend on what
  else was being sampled.

Batches hold at most ``max_sample_batch`` sequences (open ones: all together) and one weights
version each.

Versions: the sampler module shares the trainer's frozen weights and points its trainable
parameters at the snapshot carried by the request's handle (``weights.PublishedWeights``), so
a request issued with version v is sampled with exactly v's weights, even after newer
versions are published. Switching versions copies nothing.

In-flight swaps (``inflight_swap``, for the ``inflight`` scheduler): once ``swap_weights`` has
been called, a batch whose requests follow the current weights takes the newest version swapped
in before its next decode step (``Generation.reweigh``: the KV cache recomputed, ``swap_mode =
"recompute"``, or kept, ``"keep"``); every token is stamped with the version that drew it
(``SampledTokens.token_versions``). A request follows the current weights when it was issued with
them (its handle is not older than the newest swap): an evaluation that pins an older version
keeps it to the end. A request with several parts (more rows than ``max_sample_batch``) may see a
swap land at different steps in each of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
import threading
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from headrace.core.settle import call_when_settled
from headrace.core.types import SampledTokens, SamplerHandle, SamplingParams, Tokens

from .device_thread import Answers, DeviceThread
from .fast_decode import speed_up
from .flops import PerfMeter
from .generate import SWAP_MODES, Generator
from .running import Part, Request, RunningBatches
from .weights import PublishedWeights, SamplerModel

T = TypeVar("T")
BATCHING = ("window", "settled", "alone")


# decode steps per device job of the decode loop: the learner waits at most this many steps of
# every running batch for the device (see benchmarks/RESULTS.md, "In-flight updates")
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
        decode_step: bool = True,
    ):
        if swap_mode not in SWAP_MODES:
            raise ValueError(f"unknown swap mode {swap_mode!r}; use one of {', '.join(SWAP_MODES)}")
        self._model = model
        self.meter = meter  # device seconds of its jobs, tokens sampled (FLOPs: the generator's)
        speed_up(model.forward_module)  # the sampler's own module: prepacked weights, grouped attention
        self._generator = Generator(model.forward_module, pad_token_id, device, meter, decode_step=decode_step)
        self._device_thread = device_thread
        self._device = device
        self._wait_s = batch_wait_s
        self.seed = seed
        self.unseeded_requests = 0  # requests without a seed get (run seed, this count): saved in checkpoints
        self.batching = "window"  # see the module docstring
        self._lock = threading.Lock()
        self._pending: list[Part] = []
        self._looping = False  # "window": the decode loop runs or is queued (under _lock)
        self._timer: asyncio.TimerHandle | None = None
        self._settling = False  # "settled": a flush waits for the loop to settle
        # read by the engine, which checks prompts and caps max_tokens before calling sample()
        config = getattr(model.forward_module, "config", None)
        self.max_context: int | None = getattr(config, "max_position_embeddings", None)
        # in-flight swaps (see the module docstring)
        self.inflight_swap = True
        self.slice_steps = slice_steps
        self._live: SamplerHandle | None = None  # newest weights swapped in; None: swap mode unused
        # the device thread's side: running batches, joins, swaps
        self._running = RunningBatches(
            model, self._generator, device, frozenset(stop_token_ids), max_batch, swap_mode, meter
        )

    @property
    def batches(self) -> int:
        """Batches started (a request that joins a running batch starts none)."""
        return self._running.batches

    @property
    def rows(self) -> int:
        return self._running.rows

    @property
    def joined(self) -> int:
        """Rows that joined a batch already decoding (continuous batching)."""
        return self._running.joined

    def idle(self) -> bool:
        """No request waits and the decode loop has stopped."""
        with self._lock:
            return not self._looping and not self._pending

    @property
    def swaps(self) -> deque[tuple[int, int, int, float]]:
        """(version, batch rows, decode steps done before it, seconds) per swap into a running batch."""
        return self._running.swaps

    @property
    def swap_mode(self) -> str:
        return self._running.swap_mode

    @swap_mode.setter
    def swap_mode(self, mode: str) -> None:
        if mode not in SWAP_MODES:
            raise ValueError(f"unknown swap mode {mode!r}; use one of {', '.join(SWAP_MODES)}")
        self._running.swap_mode = mode

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
        request = Request(handle, list(prompt), n, params, seed, loop.create_future(), loop)
        with self._lock:
            request.follows = self._live is None or handle.version >= self._live.version
            self._pending.append(Part(request, 0, n))
            rows = sum(p.take for p in self._pending)
            looping = self._looping
        if self.batching == "window":
            if looping:
                pass  # joins the running batch at the decode loop's next step
            elif rows >= self._running.max_batch or self._wait_s <= 0:
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
            if self._looping or not self._pending:
                return  # the running loop takes what is pending at its next step
            self._looping = True
        self._submit(self._cycle, [])

    def _settled(self) -> None:
        self._settling = False
        self._send_pending()

    def _send_pending(self) -> None:
        """One device job for exactly the requests pending now (``"settled"``, ``"alone"``)."""
        with self._lock:
            parts, self._pending = self._pending, []
        if parts:
            self._submit(functools.partial(self._run, parts), parts)

    def _submit(self, job: Callable[[], None], taken: list[Part]) -> None:
        """Queue ``job`` on the device thread (``taken``: the parts it was given, if any)."""
        try:
            self._device_thread.submit_threadsafe(self._timed(job))
        except RuntimeError as e:  # the backend was closed with requests still waiting
            with self._lock:
                pending, self._pending, self._looping = self._pending, [], False
            answers = Answers()
            for part in [*taken, *pending]:
                answers.fail(part.request.loop, part.request.future, e)
            answers.send()

    # ---- device thread ----

    def _timed(self, job: Callable[[], None]) -> Callable[[], None]:
        return job if self.meter is None else self.meter.timed("sample", job)

    def _run(self, parts: list[Part]) -> None:
        """Sample ``parts`` in batches of their own (``"settled"``, ``"alone"``); their answers
        reach the loop at once, at the end. With in-flight swaps on, the batches go to the decode
        loop instead, closed to joiners, and are answered as they end."""
        with self._lock:
            live = self._live
        answers = Answers()
        if live is None:
            batches: list = []
            self._running.admit(parts, None, False, answers, into=batches)
            self._running.step(None, answers, batches)
            answers.send()
            return
        self._running.admit(parts, live, False, answers)
        answers.send()
        with self._lock:
            if self._looping:
                return
            self._looping = True
        self._cycle()

    def _cycle(self) -> None:
        """The decode loop: ``slice_steps`` decode steps of every running batch, the requests
        pending before each step joining first; then queued again, behind the learner's work, as
        long as any batch runs or any request waits."""
        answers = Answers()
        steps = 0
        while steps < self.slice_steps:
            with self._lock:
                live = self._live
                parts, self._pending = self._pending, []
            self._running.prepare(live, answers)
            if parts:
                if not self._running.running:
                    steps = 0  # the loop was about to stop: these start as on an idle one, a whole slice
                waiting = self._running.admit(parts, live, True, answers)
                if waiting:
                    with self._lock:
                        self._pending[:0] = waiting
            if not self._running.running:
                break
            self._running.step(1, answers)
            steps += 1
            answers.send()  # at once: a request answered here may be followed by its next turn
        answers.send()
        with self._lock:
            if not self._running.running and not self._pending:
                self._looping = False
                return
        try:
            self._device_thread.submit_threadsafe(self._timed(self._cycle))
        except RuntimeError as e:  # the backend is shutting down under running generations
            with self._lock:
                pending, self._pending, self._looping = self._pending, [], False
            self._running.fail_all(e, answers)
            for part in pending:
                answers.fail(part.request.loop, part.request.future, e)
            answers.send()

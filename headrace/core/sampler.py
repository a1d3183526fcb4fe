"""SamplerActor: owns the sampling backend and the current policy version.

Rollouts call ``sample``; each call is served by the weights that were current when it started
and every sampled action is stamped with their version. The learner publishes new weights
through a bounded channel that this actor's own task consumes, so a weight swap never races a
half-read handle.

Swap mode (``swap_in_flight``, the ``inflight`` scheduler): each new handle is also given to the
backend's ``swap_weights(handle)`` before any new call sees it, and calls already running go on
with the new weights; the backend then stamps each token with the version that produced it
(``SampledTokens.token_versions``). A backend says it can do this with a true ``inflight_swap``
attribute on its sampling side; one that cannot (or does not say) serves each call with one
version, and the actor stamps every token of the call with it.

Reproducible batching (``reproducible``, the ``sync`` and ``stream`` schedulers): a backend that
batches concurrent requests is told to batch them by the run's code, not by timing, through its
``batch_reproducibly()`` (``BatchesReproducibly`` in ``core/protocols.py``), so a seeded run
repeats itself.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import anyio

from headrace.core.channel import Channel
from headrace.core.episode import PromptTooLongError
from headrace.core.protocols import BatchesReproducibly, SamplingBackend, max_context, swaps_in_flight
from headrace.core.retry import Backoff, retry_transient
from headrace.core.trace import CallCompleted, CallCounter, CallSubmitted, Tracer, current_rollout
from headrace.core.types import SampledTokens, SamplerHandle, SamplingParams, StopReason, Tokens


class SamplerActor:
    def __init__(
        self,
        backend: SamplingBackend,
        initial: SamplerHandle,
        backoff: Backoff | None = None,
        tracer: Tracer | None = None,
        swap_in_flight: bool = False,
        reproducible: bool = False,
    ):
        if swap_in_flight and not swaps_in_flight(backend):
            raise ValueError(f"{type(backend).__name__} cannot swap weights during a generation")
        if reproducible and isinstance(backend, BatchesReproducibly):
            backend.batch_reproducibly()
        self._backend = backend
        self.swap_in_flight = swap_in_flight
        self._on_version: list[Callable[[int], None]] = []
        self._tracer, self._calls = tracer, CallCounter()
        self.backoff = backoff or Backoff()
        self._handle = initial
        self.weights: Channel[SamplerHandle] = Channel(maxsize=4, name="weights")
        # backends that know their context length say so; prompts are checked before sampling
        self.max_context = max_context(backend)
        self._version_changed = anyio.Event()

    @property
    def version(self) -> int:
        return self._handle.version

    @property
    def handle(self) -> SamplerHandle:
        return self._handle

    async def run(self) -> None:
        if self.swap_in_flight:  # armed before the first generation, so it too can take new weights
            self._backend.swap_weights(self._handle)  # type: ignore[attr-defined]
        async for handle in self.weights:
            if handle.version < self._handle.version:
                raise RuntimeError(f"weights went back from version {self._handle.version} to {handle.version}")
            if self.swap_in_flight and handle.version > self._handle.version:
                self._backend.swap_weights(handle)  # type: ignore[attr-defined]
            self._handle = handle
            for hook in self._on_version:
                hook(handle.version)
            self._version_changed.set()
            self._version_changed = anyio.Event()

    def on_version(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(version)`` each time new weights are taken (the inflight gate's ledger)."""
        self._on_version.append(hook)

    async def wait_for_version(self, version: int) -> None:
        while self._handle.version < version:
            await self._version_changed.wait()

    async def sample(
        self, prompt: Tokens, n: int, params: SamplingParams, handle: SamplerHandle | None = None
    ) -> list[SampledTokens]:
        """``handle``: sample these weights, not the current ones (an evaluation pins its version)."""
        cut_to_fit = False
        if self.max_context is not None:
            room = self.max_context - len(prompt)
            if room < 1:
                raise PromptTooLongError(len(prompt), self.max_context)
            if params.max_tokens > room:
                params, cut_to_fit = dataclasses.replace(params, max_tokens=room), True
        handle = self._handle if handle is None else handle
        call = self._backend.sample if self._tracer is None else self._traced_sample
        samples = await retry_transient(self.backoff, call, handle, prompt, n, params)
        if len(samples) != n:
            raise RuntimeError(f"sampling backend returned {len(samples)} samples, {n} were asked for")
        if cut_to_fit:
            samples = ended_by_context(samples)
        # stamp the handle's version, unless the backend stamped the one it really used (weights
        # swapped in place under a late request); stamped samples are not copied (the sim's)
        return [s if s.policy_version >= 0 else _stamped(s, handle.version) for s in samples]

    async def _traced_sample(
        self, handle: SamplerHandle, prompt: Tokens, n: int, params: SamplingParams
    ) -> list[SampledTokens]:
        assert self._tracer is not None
        call, rollout = self._calls.take("sample"), current_rollout.get()
        self._tracer(CallSubmitted("sample", call, rollout, time.perf_counter()))
        try:
            samples = await self._backend.sample(handle, prompt, n, params)
        except Exception:
            self._tracer(CallCompleted("sample", call, rollout, time.perf_counter(), ok=False))
            raise
        # before anything else can run: the k-th completion traced is the k-th the backend finished
        self._tracer(
            CallCompleted("sample", call, rollout, time.perf_counter(), tokens=sum(len(s.tokens) for s in samples))
        )
        return samples


def ended_by_context(samples: list[SampledTokens]) -> list[SampledTokens]:
    """Samples whose ``max_tokens`` was cut to the room left in the context: one that ran to that
    length ended because the context was full, not at the env's own limit."""
    return [
        dataclasses.replace(s, stop_reason=StopReason.CONTEXT_OVERFLOW) if s.stop_reason == StopReason.LENGTH else s
        for s in samples
    ]


def _stamped(sample: SampledTokens, version: int) -> SampledTokens:
    # one version per call: every token of it was made by the weights that served it
    return SampledTokens(sample.tokens, sample.logprobs, sample.stop_reason, version)

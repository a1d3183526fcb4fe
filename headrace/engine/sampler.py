"""SamplerActor: owns the sampling backend and the current policy version.

Rollouts call ``sample``; each call is served by the weights that were current when it started
and every sampled action is stamped with their version. The learner publishes new weights
through a bounded channel that this actor's own task consumes, so a weight swap never races a
half-read handle.
"""

from __future__ import annotations

import dataclasses

import anyio

from headrace.engine.channel import Channel
from headrace.engine.protocols import SamplingBackend
from headrace.engine.retry import retry_transient
from headrace.engine.types import SampledTokens, SamplerHandle, SamplingParams, Tokens


class SamplerActor:
    def __init__(self, backend: SamplingBackend, initial: SamplerHandle):
        self._backend = backend
        self._handle = initial
        self.weights: Channel[SamplerHandle] = Channel(maxsize=4, name="weights")
        self._version_changed = anyio.Event()
        self.requests = 0
        self.sampled_tokens = 0
        self.busy = 0  # requests in flight, for the utilisation metric

    @property
    def version(self) -> int:
        return self._handle.version

    async def run(self) -> None:
        async for handle in self.weights:
            if handle.version < self._handle.version:
                raise RuntimeError(f"weights went back from version {self._handle.version} to {handle.version}")
            self._handle = handle
            self._version_changed.set()
            self._version_changed = anyio.Event()

    async def wait_for_version(self, version: int) -> None:
        while self._handle.version < version:
            await self._version_changed.wait()

    async def sample(self, prompt: Tokens, n: int, params: SamplingParams) -> list[SampledTokens]:
        handle = self._handle
        self.requests += 1
        self.busy += 1
        try:
            samples = await retry_transient(self._backend.sample, handle, prompt, n, params)
        finally:
            self.busy -= 1
        if len(samples) != n:
            raise RuntimeError(f"sampling backend returned {len(samples)} samples, {n} were asked for")
        self.sampled_tokens += sum(len(s.tokens) for s in samples)
        return [dataclasses.replace(s, policy_version=handle.version) for s in samples]

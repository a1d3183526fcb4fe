"""What a backend provides. The engine never sees more of a backend than this.

Training calls return at once with an awaitable that is already submitted: the backend runs
them in submission order, so the learner can queue the next call before it awaits the last one
(the device never waits on Python).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, runtime_checkable

from headrace.core.types import (
    AdamParams,
    Datum,
    ForwardBackwardResult,
    LossSpec,
    OptimResult,
    SampledTokens,
    SamplerHandle,
    SamplingParams,
    Tokenizer,
    Tokens,
)


@runtime_checkable
class TrainingBackend(Protocol):
    def forward_backward(self, datums: Sequence[Datum], loss: LossSpec) -> Awaitable[ForwardBackwardResult]:
        """Submit now; the awaitable resolves when the gradients are accumulated."""

    def optim_step(self, adam: AdamParams) -> Awaitable[OptimResult]:
        """Submit now; applies and clears the accumulated gradients."""

    def publish(self, version: int) -> Awaitable[SamplerHandle]:
        """Submit now; resolves to a handle on the weights as of every call submitted before."""

    async def save_state(self, name: str) -> str:
        """Weights + optimizer state; returns a path (or URI) that ``load_state`` accepts."""

    async def load_state(self, path: str) -> None: ...


@runtime_checkable
class SamplingBackend(Protocol):
    async def sample(
        self, handle: SamplerHandle, prompt: Tokens, n: int, params: SamplingParams
    ) -> list[SampledTokens]:
        """n samples of one prompt from the weights behind ``handle``: token ids and the
        sampler's own per-token logprobs (never re-tokenised text)."""


class Backend(AbstractAsyncContextManager["Backend"], Protocol):
    """What a backend factory returns: entered once per run (starts threads, servers, engines)."""

    training: TrainingBackend
    sampling: SamplingBackend
    tokenizer: Tokenizer

    def initial_handle(self) -> SamplerHandle: ...

    def describe(self) -> dict[str, Any]:
        """A few facts for logs and benchmarks (model, device, dtype...)."""

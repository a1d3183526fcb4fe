"""What a backend provides, and what it is given. The engine never sees more of a backend than this.

Training calls return at once with an awaitable that is already submitted: the backend runs
them in submission order, so the learner can queue the next call before it awaits the last one
(the device never waits on Python).

A backend is a plugin: a ``BackendPlugin`` names it, its pydantic config section (``[NAME]`` in a
TOML file, ``--set NAME.key=value``), its command-line flags and its factory, and is published
through the ``headrace.backends`` entry-point group (headrace's own backends too)::

    [project.entry-points."headrace.backends"]
    mybackend = "mybackend:plugin"

The factory gets its validated section and a ``BackendContext`` (the run-wide facts it may read),
never the whole run configuration. Besides the protocols below, the engine looks for a few
optional attributes:

- ``sampling.max_context`` (``int | None``): the context length; a prompt that leaves no room to
  sample is refused before it is sent (``max_context(sampling)`` reads it).
- ``training.delete_state(path)``: the run deletes checkpoints beyond ``checkpoint.keep_last``
  with it (without it, every checkpoint is kept: a remote service's states, Tinker's).
- ``backend.export_base_model(dir)`` and ``backend.stop_token_ids``: what a separate sampler
  (``--sampler vllm``) needs from the training backend it samples for.
- ``backend.weights_of(handle)`` (picklable) and ``backend.handle_for(version, weights)``: a
  published version's weights moved to a sampler in another process (``--cluster ray``).
- ``training.fork()`` (awaitable, a separate ``TrainingBackend`` starting from this one's weights
  and optimizer state) and ``training.close()`` (release a fork): what ``headrace serve`` trains
  its candidates with.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

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

if TYPE_CHECKING:
    from pydantic import BaseModel


class TransientBackendError(Exception):
    """An error that may go away if the same call is made again: the run retries it with backoff
    (``retry.backoff_*``). Anything else a backend raises is not retried."""


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
        sampler's own per-token logprobs (never re-tokenised text).

        Optional, for ``--scheduler inflight``: a true ``inflight_swap`` attribute and
        ``swap_weights(handle)``, which makes generations already running go on with the weights
        behind ``handle``; each token's version is then reported in
        ``SampledTokens.token_versions``."""


class Backend(AbstractAsyncContextManager["Backend"], Protocol):
    """What a backend factory returns: entered once per run (starts threads, servers, engines)."""

    training: TrainingBackend
    sampling: SamplingBackend
    tokenizer: Tokenizer

    def initial_handle(self) -> SamplerHandle: ...

    def describe(self) -> dict[str, Any]:
        """A few facts for logs and benchmarks (model, device, dtype...)."""


def max_context(sampling: Any) -> int | None:
    """The context length a sampling backend declares (``max_context``), None if it declares none."""
    return getattr(sampling, "max_context", None)


@dataclass(frozen=True)
class BackendContext:
    """The run-wide facts a backend may read; everything else it needs is in its own section."""

    model: str = "tiny"  # 'tiny', a Hugging Face name, or a local directory (``--model``)
    seed: int = 0  # the run seed, 0 to 2**32-1
    run_dir: str | None = None  # where the run keeps checkpoints and manifests; None: the backend picks a temp dir
    resume: bool = False  # continue the run in run_dir from its last checkpoint
    sampling: SamplingParams = field(default_factory=SamplingParams)  # the run's sampling defaults
    group_size: int = 1  # samples per problem (one request asks for up to this many)
    max_concurrent_rollouts: int = 1  # groups rolled out at once, at most (each up to group_size samples)
    # on resume, the run directory's latest checkpoint (step, path): the state the run restores
    resume_checkpoint: tuple[int, str] | None = None


Flag = tuple[str, str, type, str]  # ("--tinker-url", "base_url", str, "help"): the key is in the section


@dataclass(frozen=True)
class BackendPlugin:
    """A backend as headrace finds it. Keep the module that defines it light: it is imported to
    list backends and build ``headrace run --help``, so torch, vLLM or an SDK are imported by the
    factory only.

    ``factory``: ``"module:function"`` (or the function): ``(section, ctx)`` for a training backend,
    ``(section, ctx, training_backend)`` for a sampler (``kind="sampler"``, picked with ``--sampler``),
    returning a ``Backend``. ``requires``: modules it needs (``headrace backends`` says what is
    missing, and a run stops before it starts), ``install`` how to get them."""

    name: str
    config: type[BaseModel]
    factory: str | Callable[..., Any]
    kind: Literal["training", "sampler"] = "training"
    flags: Sequence[Flag] = ()
    description: str = ""
    requires: Sequence[str] = ()
    install: str = ""
    # the model's defaults for this section where the user set none: (section, model name) -> section
    model_defaults: Callable[[Any, str], Any] | None = None

    def load_factory(self) -> Callable[..., Any]:
        if callable(self.factory):
            return self.factory
        module, _, attr = self.factory.partition(":")
        return getattr(importlib.import_module(module), attr)

    def missing(self) -> list[str]:
        """The required modules this Python cannot import."""
        import importlib.util

        return [m for m in self.requires if importlib.util.find_spec(m) is None]

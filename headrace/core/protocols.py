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
never the whole run configuration.

Optional capabilities. Besides ``TrainingBackend``, ``SamplingBackend`` and ``Backend``, the engine
checks for each of these with ``isinstance`` (each a ``runtime_checkable`` Protocol below: define
the members and the engine finds them; there is nothing to register), and does without where
they are absent. On ``backend.training``:

- ``ChecksLoss``: ``check_loss(loss)`` raises ``ConfigError`` for a loss it cannot compute, before
  the run starts (without it, the first ``forward_backward`` finds out).
- ``DeletesState``: ``delete_state(path)``; the run deletes checkpoints beyond
  ``checkpoint.keep_last`` with it (without it every checkpoint is kept, as Tinker's are).
- ``Forks``: ``fork()`` (a separate training state from this one's weights and optimizer state)
  and ``close()`` (release a fork): what ``headrace serve`` trains its candidates with.
- ``SumsGradients``: a ``gradient_sum`` attribute, the ``BackendContext.gradient_sum`` hook it was
  built with: what ``--cluster ray`` needs of a learner split over several processes.
- ``ComputesCustomLoss``: ``forward(datums)`` (each datum's target logprobs, no gradient) and
  ``forward_backward_custom(datums, loss_fn)`` (Tinker's: ``loss_fn(datums, logprobs)`` returns a
  torch scalar over per-datum logprob tensors, and its gradient is accumulated as it stands, with
  no per-token divisor): what ``headrace sft``'s held-out loss and ``headrace dpo`` use.
- ``ScoresReference``: ``reference_logprobs(datums)``, each datum's target logprobs under the
  frozen reference (the starting weights: the base with the adapter off for LoRA, what
  ``loss.kl_coef`` uses): ``headrace dpo``'s reference.

On ``backend.sampling``:

- ``DeclaresContext``: ``max_context`` (``int | None``), the context length; a prompt that leaves
  no room to sample is refused before it is sent.
- ``SwapsWeightsInFlight``: a true ``inflight_swap`` and ``swap_weights(handle)``, which makes
  generations already running go on with the weights behind ``handle`` (``--scheduler inflight``;
  each token's version is then reported in ``SampledTokens.token_versions``).
- ``ScoresTopK``: ``topk_logprobs(handle, tokens, k)``, each position's ``k`` likeliest next
  tokens under the weights behind ``handle`` (Tinker's ``topk_prompt_logprobs``): ``headrace
  sdft``'s teacher.
- ``BatchesReproducibly``: ``batch_reproducibly()``, called once before the first request of a
  reproducible run (``sync``, ``stream``): a backend that batches concurrent requests forms its
  batches from the requests pending once the event loop has settled (``core/settle.py``), not
  from those that arrived within a time window, so which requests share a batch (and so what
  each computes) does not depend on timing.

On the ``backend`` itself:

- ``ExportsBaseModel``: ``export_base_model(dir)``, a model directory of the initial weights or
  the frozen base, and ``HasStopTokens``: ``stop_token_ids``, the ids that always end a sample:
  what a separate sampler (``--sampler vllm``) needs from the training backend it samples for.
- ``ServesLocally``: ``sample_locally(dir)``, called before the backend is entered: a backend
  whose weights live elsewhere (the Tinker service) publishes versions a local sampler can save
  as adapters (``SamplerHandle.ref.save(dir)``: downloaded and converted), kept in ``dir``; what
  ``--backend tinker --sampler vllm`` needs.
- ``HasLearnerSampler``: ``learner_sampling``, the learner's own sampler beside a separate one
  (vLLM; None where there is one sampler): ``headrace serve``'s gate samples a candidate there, so
  a candidate that is rejected is never downloaded to, or loaded into, the separate engine.
- ``ReportsHandoffs``: ``handoff(version, scope)``, how a version's weights reached a separate
  sampler (seconds to download, convert, save and load), None if they never did:
  what ``headrace serve`` lists beside each version (``GET /v1/versions``).
- ``ExportsWeights``: ``export_weights(handle, dir)``, a published version as a directory other
  tools load: a PEFT adapter (LoRA) or a Hugging Face model directory (full fine-tuning); what the
  post-training commands write as ``RUN_DIR/final``.
- ``MovesWeights``: ``weights_of(handle)`` (picklable) and ``handle_for(version, weights)``: a
  published version's weights moved to a sampler in another process (``--cluster ray``).
- ``Distributes``: ``distribute(dataset)``, the run's dataset with its envs run where the backend
  puts them (``--cluster ray``'s rollout workers).

The hooks a backend gives the parts it is made of go to their constructors (the torch trainer
takes its checkpoint's extra state, its reference model and ``gradient_sum`` when it is built).
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from headrace.core.errors import (
    TransientBackendError as TransientBackendError,  # re-exported: its home before errors.py
)
from headrace.core.types import (
    AdamParams,
    Datum,
    ForwardBackwardResult,
    LossSpec,
    OptimResult,
    RLDataset,
    SampledTokens,
    SamplerHandle,
    SamplingParams,
    Tokenizer,
    Tokens,
)

if TYPE_CHECKING:
    from pydantic import BaseModel


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


# (grads, loss tokens, divisor, every loss finite) -> the same over every data-parallel rank, the
# grads summed in place: what a learner rank's trainer calls before each update
GradientSum = Callable[[list[Any], float, float, bool], tuple[float, float, bool]]


# ---- optional capabilities (the module docstring lists them) ----


@runtime_checkable
class ChecksLoss(Protocol):
    def check_loss(self, loss: LossSpec) -> None:
        """Raise ``ConfigError`` for a loss this backend cannot compute."""


@runtime_checkable
class DeletesState(Protocol):
    async def delete_state(self, path: str) -> None:
        """Remove a checkpoint ``save_state`` returned and the run no longer keeps."""


@runtime_checkable
class Forks(Protocol):
    async def fork(self) -> TrainingBackend:
        """A separate training state from these weights and this optimizer state."""

    async def close(self) -> None:
        """Release a fork no longer used."""


@runtime_checkable
class SumsGradients(Protocol):
    gradient_sum: GradientSum | None  # the hook from BackendContext.gradient_sum; None in one process


# (datums, per-datum target logprobs as torch tensors with their gradient) -> (scalar loss, metrics)
CustomLoss = Callable[[Sequence[Datum], list[Any]], tuple[Any, dict[str, float]]]


@runtime_checkable
class ComputesCustomLoss(Protocol):
    def forward(self, datums: Sequence[Datum]) -> Awaitable[list[list[float]]]:
        """Submit now; each datum's target logprobs under the current weights, no gradient kept."""

    def forward_backward_custom(self, datums: Sequence[Datum], loss_fn: CustomLoss) -> Awaitable[ForwardBackwardResult]:
        """Submit now; ``loss_fn``'s gradient accumulated for the next ``optim_step``, unscaled."""


@runtime_checkable
class ScoresReference(Protocol):
    def reference_logprobs(self, datums: Sequence[Datum]) -> Awaitable[list[list[float]]]:
        """Each datum's target logprobs under the frozen reference (the run's starting weights)."""


@runtime_checkable
class DeclaresContext(Protocol):
    max_context: int | None  # prompt + sample tokens the model takes; None = no limit known


@runtime_checkable
class SwapsWeightsInFlight(Protocol):
    inflight_swap: bool  # True where swap_weights may be called during a generation

    def swap_weights(self, handle: SamplerHandle) -> None:
        """Generations running now go on with the weights behind ``handle``."""


@runtime_checkable
class ScoresTopK(Protocol):
    async def topk_logprobs(self, handle: SamplerHandle, tokens: Tokens, k: int) -> list[list[tuple[int, float]]]:
        """Entry t: the k likeliest tokens at position t given ``tokens[:t]``, with their logprobs (entry 0 empty)."""


@runtime_checkable
class BatchesReproducibly(Protocol):
    def batch_reproducibly(self) -> None:
        """From now on, batch the requests pending once the event loop has settled."""


@runtime_checkable
class ExportsBaseModel(Protocol):
    def export_base_model(self, directory: Any) -> str:
        """A Hugging Face model directory of the initial weights or the frozen base under LoRA."""


@runtime_checkable
class ServesLocally(Protocol):
    def sample_locally(self, directory: Any) -> None:
        """Before entering: publish versions a local sampler can save as adapters
        (``SamplerHandle.ref.save(dir)``), kept in ``directory`` (a hosted trainer's weights)."""


@runtime_checkable
class HasLearnerSampler(Protocol):
    # the learner's own sampler where the backend samples elsewhere (a local vLLM over the torch
    # or a hosted learner); None where the two are one
    learner_sampling: SamplingBackend | None


@runtime_checkable
class ReportsHandoffs(Protocol):
    def handoff(self, version: int, scope: str | None) -> dict[str, Any] | None:
        """The last hand-off of that version (of the chain ``scope`` names) to the sampler, in seconds."""


@runtime_checkable
class ExportsWeights(Protocol):
    def export_weights(self, handle: SamplerHandle, directory: Any) -> str:
        """A PEFT adapter directory (LoRA) or a Hugging Face model directory of ``handle``'s weights."""


@runtime_checkable
class HasStopTokens(Protocol):
    stop_token_ids: tuple[int, ...]  # ids that always end a sample (EOS and the generation config's)


@runtime_checkable
class MovesWeights(Protocol):
    def weights_of(self, handle: SamplerHandle) -> Any:
        """A published version's weights as picklable data (numpy arrays)."""

    def handle_for(self, version: int, weights: Any) -> SamplerHandle:
        """This process's handle on weights ``weights_of`` gave in another."""


@runtime_checkable
class Distributes(Protocol):
    def distribute(self, dataset: RLDataset) -> RLDataset:
        """``dataset`` with its envs made and stepped where this backend runs them."""


def max_context(sampling: object) -> int | None:
    """The context length a sampling backend declares (``DeclaresContext``), None if it declares none."""
    return sampling.max_context if isinstance(sampling, DeclaresContext) else None


def swaps_in_flight(sampling: object) -> bool:
    """Whether a sampling backend takes new weights during a generation (``SwapsWeightsInFlight``)."""
    return isinstance(sampling, SwapsWeightsInFlight) and bool(sampling.inflight_swap)


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
    lag: int = 0  # the scheduler's: batch k is sampled once version k - lag is published
    swap_in_flight: bool = False  # the scheduler swaps weights into running generations (inflight)
    # data-parallel learner ranks (--cluster ray): the trainer sums each step's gradients over the
    # ranks with it before the update (``SumsGradients``); None in one process
    gradient_sum: GradientSum | None = None


@dataclass(frozen=True)
class InnerBackend:
    """A backend a cluster plugin is given to place: its plugin's name and its section as plain
    data (``model_dump()``), so it travels to the processes that build it
    (``headrace.plugins.backends.build_inner``)."""

    name: str
    section: dict[str, Any]


Flag = tuple[str, str, type, str]  # ("--tinker-url", "base_url", str, "help"): the key is in the section


@dataclass(frozen=True)
class BackendPlugin:
    """A backend as headrace finds it. Keep the module that defines it light: it is imported to
    list backends and build ``headrace run --help``, so torch, vLLM or an SDK are imported by the
    factory only.

    ``factory``: ``"module:function"`` (or the function): ``(section, ctx)`` for a training backend,
    ``(section, ctx, training_backend)`` for a sampler (``kind="sampler"``, picked with ``--sampler``),
    ``(section, ctx, training, sampler)`` for a cluster (``kind="cluster"``, picked with
    ``--cluster``: ``training`` and ``sampler`` are ``InnerBackend``, or None for no sampler),
    returning a ``Backend``. ``requires``: modules it needs (``headrace backends`` says what is
    missing, and a run stops before it starts), ``install`` how to get them."""

    name: str
    config: type[BaseModel]
    factory: str | Callable[..., Any]
    kind: Literal["training", "sampler", "cluster"] = "training"
    flags: Sequence[Flag] = ()
    description: str = ""
    requires: Sequence[str] = ()
    install: str = ""
    # the model's defaults for this section where the user set none: (section, model name) -> section
    model_defaults: Callable[[Any, str], Any] | None = None
    # tokens each sample carries besides the model's answer (the sim's version stamp), added to the
    # model's default sampling.max_tokens so an answer has the room it has on a real model
    extra_sample_tokens: int = 0

    def load_factory(self) -> Callable[..., Any]:
        if callable(self.factory):
            return self.factory
        module, _, attr = self.factory.partition(":")
        return getattr(importlib.import_module(module), attr)

    def missing(self) -> list[str]:
        """The required modules this Python cannot import."""
        import importlib.util

        return [m for m in self.requires if importlib.util.find_spec(m) is None]

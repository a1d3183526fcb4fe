"""What the emulator needs from a model: the seam between the Tinker wire and the real work.

``Compute`` makes trainers (one per Tinker training client) and base-model samplers. Two
implementations: ``TorchCompute`` (``compute_torch.py``: headrace's ``torch`` backend on the
``--model`` weights; training is real) and ``BigramCompute`` (``compute_bigram.py``: numpy, no torch,
milliseconds per call, for protocol and fault tests).

Losses follow Tinker's definitions: sums over target positions, ``loss:sum`` in the metrics.

Sampling follows the service: each sampled token is reported with its logprob under the plain
distribution (temperature 1, no top-k/top-p), as the learner's forward computes it; a sample
stops after a stop token (kept as its last token) or once its decoded text holds a stop string
(``stop_at_strings``: the sample ends with the token that completed the string, as the Tinker
cookbook's renderers expect when they split the decoded text on it). Prompt logprobs (and top-k
prompt logprobs) are computed on the sampler's own weights: NaN at position 0, which has no
context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from headrace.tinker_emulator.codec import WireDatum

Sequence3 = tuple[list[int], list[float], str]  # tokens, logprobs, "stop" | "length"

TOPK_MASK_LOGPROB = -99999.0  # the wire's filler for a top-k cell with nothing in it


@dataclass(frozen=True)
class SampleSpec:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop_tokens: tuple[int, ...] | None = None  # None: the model's own (EOS); (): none at all
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class PromptLogprobs:
    logprobs: np.ndarray  # float32 [T]: NaN at 0
    topk_ids: np.ndarray | None = None  # int32 [T, k]; row 0 is filler (id 0, TOPK_MASK_LOGPROB)
    topk_logprobs: np.ndarray | None = None  # float32 [T, k]


class Sampler(Protocol):
    vocab_size: int

    async def sample(self, prompt: list[int], n: int, spec: SampleSpec) -> list[Sequence3]: ...

    async def prompt_logprobs(self, prompt: list[int], topk: int) -> PromptLogprobs: ...

    def decode(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens``, for stop strings."""


class Trainer(Protocol):
    async def forward_backward(
        self, data: list[WireDatum], loss_fn: str, config: dict[str, Any], forward_only: bool
    ) -> tuple[list[list[float]], dict[str, float]]: ...

    async def optim_step(self, adam: dict[str, float]) -> dict[str, float]: ...

    async def save(self) -> Any:
        """An opaque snapshot of weights + optimizer state, kept by the emulator."""

    async def load(self, blob: Any, optimizer: bool) -> None: ...

    async def sampler(self) -> Sampler:
        """A sampler on a frozen copy of the current weights."""

    async def close(self) -> None: ...

    # optional: ``async def poison(self)``, the nan_loss fault: make the pending gradient non-finite


class Compute(Protocol):
    models: list[str]  # the models it computes with; the emulator maps every asked-for name onto one

    def vocab_size(self, model: str) -> int | None:
        """How many token ids ``model`` takes (None: not known before it loads)."""

    def max_context(self, model: str) -> int | None: ...

    async def create(self, base_model: str, lora: dict[str, Any]) -> Trainer:
        """``lora``: Tinker's LoraConfig as sent (rank, seed, train_mlp, train_attn, train_unembed)."""

    async def base_sampler(self, base_model: str) -> Sampler: ...

    async def close(self) -> None: ...


LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo")


def loss_and_grad(
    loss_fn: str, config: dict[str, Any], logp: np.ndarray, inputs: dict[str, np.ndarray]
) -> tuple[float, np.ndarray]:
    """Tinker's loss on one datum's target logprobs, and dLoss/dlogp."""
    if loss_fn == "cross_entropy":
        w = inputs.get("weights", np.ones_like(logp))
        return float(-(w * logp).sum()), -w
    if loss_fn not in LOSSES:
        why = (
            " (its objective is not published, and it reads stability information the service records when it "
            "samples; with the Tinker cookbook's async loop, set AsyncConfig.loss_fn, e.g. to 'ppo')"
            if loss_fn == "stable_reinforce"
            else ""
        )
        raise ValueError(f"loss '{loss_fn}' is not served by the emulator{why}; use one of {', '.join(LOSSES)}")
    adv, old = inputs["advantages"], inputs["logprobs"]
    ratio = np.exp(logp - old)
    lo, hi = float(config.get("clip_low_threshold", 0.8)), float(config.get("clip_high_threshold", 1.2))
    if loss_fn == "importance_sampling":
        return float(-(ratio * adv).sum()), -ratio * adv
    if loss_fn == "ppo":
        clipped = np.clip(ratio, lo, hi)
        unclipped_active = ratio * adv <= clipped * adv
        return float(-np.minimum(ratio * adv, clipped * adv).sum()), np.where(unclipped_active, -ratio * adv, 0.0)
    clipped = np.clip(ratio, lo, hi)  # cispo: stop-gradient on the clipped ratio
    return float(-(clipped * adv * logp).sum()), -clipped * adv


def vocabulary_error(what: str, token: int, vocab: int) -> str:
    return (
        f"{what} holds token id {token}, outside the served model's vocabulary of {vocab} token ids "
        f"(0 to {vocab - 1}). Encode with the served model's tokenizer, or start the emulator on a model "
        "whose vocabulary covers these ids (--model; with --compute bigram, --vocab-size)."
    )


def check_token_ids(what: str, ids: Sequence[int] | np.ndarray, vocab: int | None) -> None:
    """``ValueError`` (a client error) naming the vocabulary size, for an id the model has no row for."""
    if vocab is None or len(ids) == 0:
        return
    arr = np.asarray(ids, dtype=np.int64)
    bad = (arr < 0) | (arr >= vocab)
    if bad.any():
        raise ValueError(vocabulary_error(what, int(arr[np.argmax(bad)]), vocab))


def stop_at_strings(seq: Sequence3, stops: tuple[str, ...], decode: Callable[[Sequence[int]], str]) -> Sequence3:
    """``seq`` cut after the first token whose text completes one of ``stops`` (then ``"stop"``);
    unchanged if its text holds none of them."""
    tokens, logprobs, reason = seq
    if not stops or not tokens or not any(s in decode(tokens) for s in stops):
        return seq
    for end in range(1, len(tokens) + 1):
        text = decode(tokens[:end])
        if any(s in text for s in stops):
            return tokens[:end], logprobs[:end], "stop"
    return seq


def empty_topk(length: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((length, k), dtype=np.int32), np.full((length, k), TOPK_MASK_LOGPROB, dtype=np.float32)


# -- the bigram compute -------------------------------------------------------------------------

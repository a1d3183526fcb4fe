"""The losses, by their Tinker names, on padded ``[batch, time]`` tensors.

Each returns the loss **summed** over the tokens where ``mask`` is 1 (as Tinker does) and a
few summed statistics. The trainer divides the accumulated gradient by the number of loss
tokens of the whole optimizer step (see ``trainer.py``), so the update is a per-token mean
that does not depend on how a step is split into ``forward_backward`` calls.

``ratio`` is exp(learner logprob - sampler logprob) per token:

- ``importance_sampling``: -ratio * A (REINFORCE, off-policy corrected)
- ``ppo``: -min(ratio * A, clip(ratio, low, high) * A)
- ``cispo``: -stopgrad(clip(ratio, low, high)) * A * logprob
- ``cross_entropy``: -logprob (supervised; advantages are ignored)

``low``/``high`` are ratio bounds: ``LossSpec.config["clip_low_threshold"]`` (default 0.8) and
``["clip_high_threshold"]`` (default 1.2).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from headrace.core.types import LOSS_NAMES

# a log-ratio beyond this is numerically meaningless and would overflow exp() in low precision
_MAX_LOG_RATIO = 20.0

LossFn = Callable[[Tensor, Tensor, Tensor, Tensor, Mapping[str, float]], tuple[Tensor, dict[str, Tensor]]]


def _ratio(logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> Tensor:
    log_ratio = (logp - sampler_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    # masked positions (prompt, padding) hold arbitrary values: keep them out of exp()
    return torch.where(mask > 0, log_ratio, torch.zeros_like(log_ratio)).exp()


def _bounds(config: Mapping[str, float]) -> tuple[float, float]:
    low = float(config.get("clip_low_threshold", 0.8))
    high = float(config.get("clip_high_threshold", 1.2))
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(f"clip thresholds are ratio bounds and need 0 <= low <= 1 <= high, got {low}, {high}")
    return low, high


def importance_sampling(logp, sampler_logp, adv, mask, config):
    ratio = _ratio(logp, sampler_logp, mask)
    return -(ratio * adv * mask).sum(), {"ratio": (ratio.detach() * mask).sum()}


def ppo(logp, sampler_logp, adv, mask, config):
    low, high = _bounds(config)
    ratio = _ratio(logp, sampler_logp, mask)
    unclipped = ratio * adv
    clipped = ratio.clamp(low, high) * adv
    objective = torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).float() * mask
    return -(objective * mask).sum(), {"ratio": (ratio.detach() * mask).sum(), "clipped": was_clipped.sum()}


def cispo(logp, sampler_logp, adv, mask, config):
    low, high = _bounds(config)
    ratio = _ratio(logp, sampler_logp, mask).detach()
    weight = ratio.clamp(low, high)
    was_clipped = (weight != ratio).float() * mask
    # where() keeps -inf logprobs of masked positions from turning 0 * -inf into nan
    logp = torch.where(mask > 0, logp, torch.zeros_like(logp))
    return -(weight * adv * logp * mask).sum(), {"ratio": (ratio * mask).sum(), "clipped": was_clipped.sum()}


def cross_entropy(logp, sampler_logp, adv, mask, config):
    logp = torch.where(mask > 0, logp, torch.zeros_like(logp))
    return -(logp * mask).sum(), {}


LOSSES: dict[str, LossFn] = {
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "cross_entropy": cross_entropy,
}
assert set(LOSSES) == set(LOSS_NAMES)


def get_loss(name: str) -> LossFn:
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss '{name}'; valid losses: {', '.join(LOSSES)}") from None

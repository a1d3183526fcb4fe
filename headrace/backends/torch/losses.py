"""The losses, by name, on padded ``[batch, time]`` tensors: Tinker's four, and off-policy
corrections for samples that the learner's current weights did not produce.

Three policies meet in a loss (AReaL's names):

- the *behaviour* policy ``b``: the sampler's logprobs, carried by each datum;
- the *proximal* policy ``prox``: the learner's weights at the start of the optimizer step, the
  logprobs its forward pass computes, without a gradient;
- the policy being trained ``θ``, the same forward pass with its gradient.

A step is one optimizer update here (its ``forward_backward`` calls all run before its
``optim_step``), so ``π_θ/π_prox`` is 1 in value at every call and only its gradient,
``∇log π_θ``, moves the weights; the off-policy gap is entirely ``π_prox/π_b``. That is why
``decoupled_ppo`` needs no extra forward pass: ``prox`` is the detached ``logp``.

Per token, with ``r = π_θ/π_b``, ``w = π_prox/π_b`` (no gradient) and ``ρ = π_θ/π_prox``:

- ``importance_sampling``: ``-r·A`` (REINFORCE, importance-corrected, unbounded)
- ``ppo``: ``-min(r·A, clip(r)·A)``: the sampler is PPO's old policy ("naive" PPO when stale)
- ``cispo``: ``-sg(clip(r))·A·log π_θ``
- ``cross_entropy``: ``-log π_θ`` (supervised; advantages are ignored)
- ``decoupled_ppo`` (AReaL): ``-min(w, is_cap)·min(ρ·A, clip(ρ)·A)``: PPO's trust region
  around the proximal policy, the behaviour gap corrected by a truncated weight. AReaL *drops*
  tokens whose weight exceeds its cap; this truncates them (TIS-style), so no token is lost.
- ``tis``: ``-min(w, is_cap)·ρ·A``: truncated importance sampling (Yao et al.); is_cap = inf
  is ``importance_sampling``
- ``mis``: ``-w·1[mis_low <= w <= mis_high]·ρ·A``: masked importance sampling (IcePop-style):
  a token whose weight is out of bounds is dropped, the others keep their weight
- ``gspo``: GSPO-token (Zheng et al., as Tinker implements it): every token carries the
  sequence ratio ``s = exp(mean_t log r_t)``, with its own token's gradient, PPO-clipped

``is_level = "sequence"`` makes ``tis``/``mis`` take ``w`` per sequence, as GSPO does: the
geometric mean of the sequence's token weights (a product would overflow on long answers).

``kl_coef > 0`` adds ``kl_coef·k`` per token, ``k`` an estimator of KL(π_θ || π_ref) on the
sampled tokens: ``k1 = log π_θ - log π_ref``, ``k3 = π_ref/π_θ - log(π_ref/π_θ) - 1`` (>= 0).

``low``/``high`` (``clip_low_threshold``/``clip_high_threshold``, defaults 0.8/1.2) are ratio
bounds, as Tinker's. Each loss returns its **sum** over the loss tokens, each token scaled by
the aggregation weight the trainer gives it (see ``trainer.py``), and summed statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from headrace.core.types import LOSS_NAMES

# a log-ratio beyond this is numerically meaningless and would overflow exp() in low precision
_MAX_LOG_RATIO = 20.0

DEFAULTS: dict[str, float | str] = {
    "clip_low_threshold": 0.8,
    "clip_high_threshold": 1.2,
    "is_cap": 2.0,
    "mis_low": 0.5,
    "mis_high": 2.0,
    "is_level": "token",
    "kl_coef": 0.0,
    "kl_estimator": "k3",
}


@dataclass
class LossInputs:
    """One padded microbatch. ``mask`` is 1 on loss tokens; everything else is ignored there,
    whatever it holds (a masked position's logprob may even be -inf)."""

    logp: Tensor  # the learner's logprobs, with their gradient
    sampler_logp: Tensor  # the behaviour policy's
    adv: Tensor
    mask: Tensor
    prox_logp: Tensor | None = None  # None: logp without its gradient (the weights at the start of the step)
    ref_logp: Tensor | None = None  # the frozen reference's, when kl_coef > 0


@dataclass
class TokenTerms:
    """A loss per token (before masking and aggregation) and what it did to each token."""

    loss: Tensor
    clipped: Tensor | None = None  # a clip or a truncation changed the token's weight
    masked: Tensor | None = None  # the token was dropped from the loss


Options = Mapping[str, float | str]
TokenLoss = Callable[["_Prepared", Options], TokenTerms]


@dataclass
class _Prepared:
    logp: Tensor  # 0 off the mask, so nothing there reaches exp() or a gradient
    behav: Tensor
    prox: Tensor
    adv: Tensor
    mask: Tensor  # bool

    def log_ratio(self, num: Tensor, den: Tensor) -> Tensor:
        lr = (num - den).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.where(self.mask, lr, torch.zeros_like(lr))

    def sequence_mean(self, values: Tensor) -> Tensor:
        """Each row's mean over its loss tokens, broadcast back over the row."""
        m = self.mask.to(values.dtype)
        return ((values * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)).expand_as(values)


def _opt(config: Options, key: str) -> float:
    return float(config.get(key, DEFAULTS[key]))


def _bounds(config: Options, low_key: str = "clip_low_threshold", high_key: str = "clip_high_threshold"):
    low, high = _opt(config, low_key), _opt(config, high_key)
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(f"{low_key}/{high_key} are ratio bounds and need 0 <= low <= 1 <= high, got {low}, {high}")
    return low, high


def _behaviour_weight(p: _Prepared, config: Options) -> Tensor:
    """``π_prox/π_b``, per token or per sequence (``is_level``); no gradient."""
    log_w = p.log_ratio(p.prox, p.behav)
    level = str(config.get("is_level", DEFAULTS["is_level"]))
    if level == "sequence":
        log_w = torch.where(p.mask, p.sequence_mean(log_w), torch.zeros_like(log_w))
    elif level != "token":
        raise ValueError(f"is_level must be 'token' or 'sequence', got '{level}'")
    return log_w.exp()


def _clipped_objective(ratio: Tensor, adv: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    unclipped = ratio * adv
    clipped = ratio.clamp(low, high) * adv
    return torch.minimum(unclipped, clipped), clipped < unclipped


def importance_sampling(p: _Prepared, config: Options) -> TokenTerms:
    return TokenTerms(-p.log_ratio(p.logp, p.behav).exp() * p.adv)


def ppo(p: _Prepared, config: Options) -> TokenTerms:
    objective, clipped = _clipped_objective(p.log_ratio(p.logp, p.behav).exp(), p.adv, *_bounds(config))
    return TokenTerms(-objective, clipped=clipped)


def cispo(p: _Prepared, config: Options) -> TokenTerms:
    low, high = _bounds(config)
    ratio = p.log_ratio(p.logp, p.behav).exp().detach()
    weight = ratio.clamp(low, high)
    return TokenTerms(-weight * p.adv * p.logp, clipped=weight != ratio)


def cross_entropy(p: _Prepared, config: Options) -> TokenTerms:
    return TokenTerms(-p.logp)


def decoupled_ppo(p: _Prepared, config: Options) -> TokenTerms:
    cap = _opt(config, "is_cap")
    w = _behaviour_weight(p, config)
    objective, clipped = _clipped_objective(p.log_ratio(p.logp, p.prox).exp(), p.adv, *_bounds(config))
    return TokenTerms(-w.clamp(max=cap) * objective, clipped=clipped | (w > cap))


def tis(p: _Prepared, config: Options) -> TokenTerms:
    cap = _opt(config, "is_cap")
    w = _behaviour_weight(p, config)
    return TokenTerms(-w.clamp(max=cap) * p.log_ratio(p.logp, p.prox).exp() * p.adv, clipped=w > cap)


def mis(p: _Prepared, config: Options) -> TokenTerms:
    low, high = _bounds(config, "mis_low", "mis_high")
    w = _behaviour_weight(p, config)
    out = (w < low) | (w > high)
    weight = torch.where(out, torch.zeros_like(w), w)
    return TokenTerms(-weight * p.log_ratio(p.logp, p.prox).exp() * p.adv, masked=out)


def gspo(p: _Prepared, config: Options) -> TokenTerms:
    log_s = p.sequence_mean(p.log_ratio(p.logp.detach(), p.behav))
    # the sequence ratio's value, each token's own gradient (GSPO-token)
    ratio = torch.where(p.mask, log_s + p.logp - p.logp.detach(), torch.zeros_like(log_s)).exp()
    objective, clipped = _clipped_objective(ratio, p.adv, *_bounds(config))
    return TokenTerms(-objective, clipped=clipped)


TOKEN_LOSSES: dict[str, TokenLoss] = {
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "cross_entropy": cross_entropy,
    "decoupled_ppo": decoupled_ppo,
    "tis": tis,
    "mis": mis,
    "gspo": gspo,
}
assert set(TOKEN_LOSSES) == set(LOSS_NAMES)


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per token, an estimate of KL(π_θ || π_ref) from tokens sampled by (about) π_θ."""
    log_r = (ref_logp - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # log π_ref/π_θ
    if estimator == "k1":
        return -log_r
    if estimator == "k3":
        return log_r.exp() - log_r - 1.0
    raise ValueError(f"kl_estimator must be 'k1' or 'k3', got '{estimator}'")


def compute(name: str, inputs: LossInputs, config: Options, weight: Tensor | None = None):
    """Loss ``name`` summed over the loss tokens, each scaled by its ``mask`` value and by
    ``weight`` (the trainer's aggregation; default 1), and its statistics summed over the loss tokens: ``ratio``
    (π_θ/π_b), ``ratio_max``/``ratio_min`` (None without loss tokens), ``clipped``, ``masked``,
    ``kl_ref`` (the reference KL estimate, when ``kl_coef > 0``) and ``tokens``."""
    token_loss = get_token_loss(name)
    # != 0, not > 0: a negative cross_entropy weight pushes its token down (Tinker's weights may
    # be signed: forward_backward_custom sends minus the custom loss's gradient as them)
    mask = inputs.mask != 0
    zero = torch.zeros_like(inputs.logp)

    def on_mask(x: Tensor) -> Tensor:
        return torch.where(mask, x, zero)

    logp = on_mask(inputs.logp)
    prox = logp.detach() if inputs.prox_logp is None else on_mask(inputs.prox_logp)
    p = _Prepared(logp, on_mask(inputs.sampler_logp), prox, on_mask(inputs.adv), mask)
    terms = token_loss(p, config)
    per_token = terms.loss
    kl_coef = _opt(config, "kl_coef")
    stats: dict[str, Tensor | None] = {}
    if kl_coef > 0:
        if inputs.ref_logp is None:
            raise ValueError("kl_coef > 0 needs the reference policy's logprobs (ref_logp)")
        k = kl_estimate(logp, on_mask(inputs.ref_logp), str(config.get("kl_estimator", DEFAULTS["kl_estimator"])))
        per_token = per_token + kl_coef * k
        stats["kl_ref"] = on_mask(k.detach()).sum()
    # a fractional mask (cross_entropy's weights) weighs its tokens, as Tinker's does
    scale = inputs.mask if weight is None else weight * inputs.mask
    # where(), not a product: a masked position's loss may be inf or nan (0 * inf)
    total = torch.where(mask, per_token * scale, zero).sum()
    with torch.no_grad():
        ratio = p.log_ratio(logp, p.behav).exp()
        any_token = bool(mask.any())
        stats |= {
            "ratio": on_mask(ratio).sum(),
            "ratio_max": ratio[mask].max() if any_token else None,
            "ratio_min": ratio[mask].min() if any_token else None,
            "clipped": (terms.clipped & mask).sum() if terms.clipped is not None else torch.zeros(()),
            "masked": (terms.masked & mask).sum() if terms.masked is not None else torch.zeros(()),
            "tokens": mask.sum(),
        }
    return total, stats


AGGREGATIONS = ("token_mean", "sequence_mean", "dr_grpo")


def check(name: str, config: Options) -> None:
    """Refuse an unknown loss or an option out of range (ValueError) before any work."""
    get_token_loss(name)
    _bounds(config)
    _bounds(config, "mis_low", "mis_high")
    if _opt(config, "is_cap") < 1.0:
        raise ValueError(
            f"is_cap must be at least 1 (a weight cap below 1 shrinks on-policy tokens), got {_opt(config, 'is_cap')}"
        )
    choices = {"is_level": ("token", "sequence"), "kl_estimator": ("k1", "k3"), "aggregation": AGGREGATIONS}
    for key, valid in choices.items():
        value = str(config.get(key, DEFAULTS.get(key, valid[0])))
        if value not in valid:
            raise ValueError(f"{key} must be one of {', '.join(valid)}, got '{value}'")
    if _opt(config, "kl_coef") < 0:
        raise ValueError(f"kl_coef must be >= 0, got {_opt(config, 'kl_coef')}")
    if config.get("aggregation") == "dr_grpo" and not float(config.get("normalizer", 0.0) or 0.0) > 0:
        raise ValueError("aggregation 'dr_grpo' needs normalizer > 0 (tokens per sequence in the divisor)")


def get_token_loss(name: str) -> TokenLoss:
    try:
        return TOKEN_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss '{name}'; valid losses: {', '.join(TOKEN_LOSSES)}") from None


LossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]


def get_loss(name: str) -> LossFn:
    """``(logp, sampler_logp, advantages, mask, config, weight=None, ref_logp=None) -> (summed
    loss, summed stats)``: :func:`compute` for loss ``name``, the proximal policy at ``logp``
    (one update per step); the statistics without a loss token (ratio_max/min) are left out."""
    get_token_loss(name)

    def loss(
        logp: Tensor,
        sampler_logp: Tensor,
        adv: Tensor,
        mask: Tensor,
        config: Options,
        weight: Tensor | None = None,
        ref_logp: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        total, stats = compute(name, LossInputs(logp, sampler_logp, adv, mask, ref_logp=ref_logp), config, weight)
        return total, {k: v for k, v in stats.items() if v is not None}

    return loss


def token_weights(name: str, mask: Tensor, config: Options) -> tuple[Tensor | None, float]:
    """``loss.aggregation``: each loss token's weight (None: 1) and what this microbatch adds to the step's divisor."""
    if name == "token_mean":
        return None, float(mask.abs().sum())  # signed weights (see compute) weigh by their size
    tokens = (mask != 0).sum(-1)
    sequences = float((tokens > 0).sum())
    if name == "sequence_mean":
        per_row = 1.0 / tokens.clamp(min=1).to(mask.dtype)
        return per_row[:, None].expand_as(mask), sequences
    if name == "dr_grpo":
        normalizer = float(config.get("normalizer", 0.0) or 0.0)
        if normalizer <= 0:
            raise ValueError("loss.aggregation='dr_grpo' needs loss.normalizer > 0 (tokens per sequence)")
        return None, sequences * normalizer
    raise ValueError(f"loss.aggregation must be token_mean, sequence_mean or dr_grpo, got '{name}'")

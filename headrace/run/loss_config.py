"""``loss.*``: the policy loss of the run config, and the ``LossSpec`` the learner gets from it."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from headrace.core.errors import did_you_mean
from headrace.core.types import LOSS_NAMES, LossSpec


class LossConfig(BaseModel):
    """The policy loss and its options (``headrace/backends/torch/losses.py`` defines each).

    Off-policy corrections for stale samples (``--scheduler async``) and sampler-learner
    mismatch: ``decoupled_ppo`` (AReaL), ``tis``/``mis`` (truncated / masked importance
    sampling), ``gspo`` (sequence-level ratio). ``aggregation`` is how token losses become the
    step's update; ``kl_coef > 0`` adds a KL penalty to the frozen initial model."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    name: str = Field(
        "importance_sampling",
        description="importance_sampling | ppo | cispo | cross_entropy | decoupled_ppo | tis | mis | gspo",
    )

    @field_validator("name")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        if name not in LOSS_NAMES:
            raise ValueError(
                f"unknown loss '{name}'; valid losses: {', '.join(LOSS_NAMES)}{did_you_mean(name, list(LOSS_NAMES))}"
            )
        return name

    clip_low_threshold: float = Field(
        0.8, ge=0.0, le=1.0, description="ratio lower bound of the clip (ppo, cispo, decoupled_ppo, gspo)"
    )
    clip_high_threshold: float = Field(
        1.2, ge=1.0, description="ratio upper bound of the clip (GSPO's paper: 0.9997/1.0004 with many updates a batch)"
    )
    is_cap: float = Field(
        2.0, ge=1.0, description="tis: importance weights truncated at this; decoupled_ppo: the behaviour weight's cap"
    )
    mis_low: float = Field(0.5, ge=0.0, le=1.0, description="mis: a token whose weight is below this is dropped")
    mis_high: float = Field(2.0, ge=1.0, description="mis: a token whose weight is above this is dropped")
    is_level: Literal["token", "sequence"] = Field(
        "token", description="tis, mis, decoupled_ppo: importance weight per token, or per sequence (geometric mean)"
    )
    aggregation: Literal["token_mean", "sequence_mean", "dr_grpo"] = Field(
        "token_mean",
        description="token_mean: the step's per-token mean; sequence_mean: the mean of each sequence's mean (GRPO); "
        "dr_grpo: the token sum / (sequences x loss.normalizer)",
    )
    normalizer: float | None = Field(
        None, gt=0.0, description="dr_grpo: tokens per sequence in the divisor; None = sampling.max_tokens"
    )
    kl_coef: float = Field(0.0, ge=0.0, description="weight of the KL penalty to the frozen initial model; 0 = none")
    kl_estimator: Literal["k1", "k3"] = Field(
        "k3", description="k1 = log(p/p_ref); k3 = p_ref/p - log(p_ref/p) - 1 (never negative)"
    )

    # the options that change each loss, beside those every loss reads (aggregation, kl_*)
    _USES: ClassVar[dict[str, tuple[str, ...]]] = {
        "clip_low_threshold": ("ppo", "cispo", "decoupled_ppo", "gspo"),
        "clip_high_threshold": ("ppo", "cispo", "decoupled_ppo", "gspo"),
        "is_cap": ("tis", "decoupled_ppo"),
        "mis_low": ("mis",),
        "mis_high": ("mis",),
        "is_level": ("tis", "mis", "decoupled_ppo"),
    }

    @model_validator(mode="after")
    def _no_idle_options(self) -> LossConfig:
        """An option that the chosen loss ignores, set away from its default, is a mistake (a
        typo'd loss name, a half-edited config): refused, not silently ignored."""
        idle = []
        for option, losses in self._USES.items():
            value = getattr(self, option)
            if self.name not in losses and value != type(self).model_fields[option].default:
                readers = ", ".join(losses)
                idle.append(f"loss.{option}={value!r} does nothing with loss '{self.name}' (only {readers} read it)")
        if self.normalizer is not None and self.aggregation != "dr_grpo":
            idle.append(f"loss.normalizer does nothing with aggregation '{self.aggregation}' (only dr_grpo reads it)")
        if self.kl_estimator != "k3" and self.kl_coef == 0:
            idle.append("loss.kl_estimator does nothing while loss.kl_coef is 0")
        if idle:
            raise ValueError(
                "; ".join(idle) + ". Remove the option, or pick the loss (aggregation, kl_coef) that reads it"
            )
        return self

    def spec(self, max_tokens: int) -> LossSpec:
        """What the training backend gets: the loss's name and the options it reads (only those,
        so a backend sees just what it must honour or refuse). ``max_tokens``
        (``sampling.max_tokens``) is dr_grpo's default normaliser."""
        config: dict[str, float | str] = {
            option: getattr(self, option) for option, losses in self._USES.items() if self.name in losses
        }
        if self.aggregation != "token_mean":
            config["aggregation"] = self.aggregation
        if self.aggregation == "dr_grpo":
            config["normalizer"] = float(self.normalizer or max_tokens)
        if self.kl_coef > 0:
            config |= {"kl_coef": self.kl_coef, "kl_estimator": self.kl_estimator}
        return LossSpec(self.name, config)

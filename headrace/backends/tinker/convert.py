"""headrace types ↔ Tinker SDK types. Token ids and logprobs pass through as numbers: nothing
is ever decoded and re-encoded."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from tinker import types

from headrace.core.errors import ConfigError
from headrace.core.types import (
    AdamParams,
    Datum,
    ForwardBackwardResult,
    LossSpec,
    OptimResult,
    SampledTokens,
    SamplingParams,
    StopReason,
)

# Tinker computes the loss on the service: only its built-in losses can run there, and only with
# what their inputs carry (the sampler's logprobs, advantages, clip bounds)
TINKER_LOSSES = ("importance_sampling", "ppo", "cispo", "gspo", "cross_entropy")
CLIPPED_LOSSES = ("ppo", "cispo", "gspo")
_WHY_NOT = {
    "decoupled_ppo": "it weighs each token by the learner's own (proximal) logprob over the sampler's, which "
    "exists only inside the service's forward pass, and no built-in loss takes such a weight",
    "tis": "its truncated weight min(learner/sampler, is_cap) needs the learner's logprob of each token, which "
    "exists only inside the service's forward pass, and no built-in loss truncates its ratio",
    "mis": "its mask drops tokens by the ratio learner/sampler, which exists only inside the service's forward "
    "pass, and no built-in loss masks by it",
}


def check_loss(loss: LossSpec) -> None:
    """Refuse, with the reason and the alternatives, a loss or option Tinker's built-in losses
    cannot compute (``forward_backward_custom`` could, at an extra forward pass a step; not done)."""
    works = f"Losses that run on Tinker: {', '.join(TINKER_LOSSES)}"
    if loss.name not in TINKER_LOSSES:
        why = _WHY_NOT.get(loss.name, "Tinker has no such built-in loss")
        raise ConfigError(
            f"loss '{loss.name}' cannot run on the tinker backend: {why}. {works}; for stale samples (--scheduler "
            "async) 'ppo' is the stable choice (its clip bounds the ratio to the sampler), or use the torch backend, "
            "which computes every loss."
        )
    if float(loss.config.get("kl_coef", 0.0)) > 0:
        raise ConfigError(
            "loss.kl_coef > 0 cannot run on the tinker backend: the KL penalty needs the reference model's logprobs "
            "inside the loss, and Tinker's built-in losses have no KL term. Set loss.kl_coef=0 (or add the penalty "
            "to the reward, as the Tinker cookbook's kl_penalty_coef does), or use the torch backend."
        )


def _aggregation_scale(d: Datum, loss: LossSpec) -> float:
    """Tinker sums each loss over its tokens (headrace applies no per-step divisor there): an
    aggregation other than that is a per-datum scale of the advantages (or weights), exact for
    every built-in loss since each is linear in them."""
    aggregation = loss.config.get("aggregation", "token_mean")
    if aggregation == "sequence_mean":
        return 1.0 / max(d.num_loss_tokens, 1)
    if aggregation == "dr_grpo":
        return 1.0 / float(loss.config.get("normalizer", 1.0))
    return 1.0


def to_datum(d: Datum, loss: LossSpec) -> types.Datum:
    """``cross_entropy`` takes ``weights`` (the mask); the policy losses take the sampler's
    logprobs and the advantages, zeroed off the mask (Tinker has no mask input), and ``gspo`` the
    mask as ``sequence_ratio_mask`` (the tokens its sequence ratio averages over)."""
    check_loss(loss)
    mask = np.asarray(d.mask, dtype=np.float32)
    scale = np.float32(_aggregation_scale(d, loss))
    inputs: dict[str, Any] = {"target_tokens": types.TensorData.from_numpy(np.asarray(d.target_tokens, dtype=np.int64))}
    if loss.name == "cross_entropy":
        inputs["weights"] = types.TensorData.from_numpy(mask * scale)
    else:
        logprobs = np.asarray(d.logprobs, dtype=np.float32) * mask
        advantages = np.asarray(d.advantages, dtype=np.float32) * mask * scale
        inputs["logprobs"] = types.TensorData.from_numpy(logprobs)
        inputs["advantages"] = types.TensorData.from_numpy(advantages)
        if loss.name == "gspo":
            inputs["sequence_ratio_mask"] = types.TensorData.from_numpy((mask != 0).astype(np.float32))
    return types.Datum(model_input=types.ModelInput.from_ints(list(d.model_input)), loss_fn_inputs=inputs)


def loss_config(loss: LossSpec) -> dict[str, float] | None:
    check_loss(loss)
    if loss.name in CLIPPED_LOSSES:
        return {
            k: float(v) for k, v in loss.config.items() if k in ("clip_low_threshold", "clip_high_threshold")
        } or None
    return None


def ratio_stats(datums: Sequence[Datum], logprobs_D: Sequence[Sequence[float]]) -> dict[str, float]:
    """The importance ratio learner/sampler over the loss tokens, from the logprobs the service's
    forward pass returned (what the torch backend reports as ``loss/ratio_*``)."""
    log_ratios = [
        lp - b
        for d, row in zip(datums, logprobs_D, strict=True)
        for lp, b, m in zip(row, d.logprobs, d.mask, strict=False)
        if m != 0
    ]
    if not log_ratios:
        return {}
    ratios = np.exp(np.clip(np.asarray(log_ratios, dtype=np.float64), -20.0, 20.0))
    return {
        "loss/ratio_mean": float(ratios.mean()),
        "loss/ratio_max:max": float(ratios.max()),
        "loss/ratio_min:min": float(ratios.min()),
    }


def _metric_name(key: str) -> str:
    name, _, reduction = key.partition(":")
    return name if reduction in ("", "sum") else f"{name}_{reduction}"


def metrics(raw: dict[str, float] | None) -> dict[str, float]:
    """Tinker's ``name:reduction`` keys as headrace metric names (``loss:sum`` → ``loss``)."""
    return {_metric_name(k): float(v) for k, v in (raw or {}).items()}


def fb_result(out: types.ForwardBackwardOutput, datums: Sequence[Datum]) -> ForwardBackwardResult:
    logprobs_D = [o["logprobs"].to_numpy().astype(float).ravel().tolist() for o in out.loss_fn_outputs]
    if len(logprobs_D) != len(datums):
        raise ValueError(f"Tinker returned {len(logprobs_D)} logprob rows for {len(datums)} datums")
    result = metrics(out.metrics) | ratio_stats(datums, logprobs_D)
    result["loss_tokens"] = float(sum(d.num_loss_tokens for d in datums))
    return ForwardBackwardResult(logprobs_D=logprobs_D, metrics=result)


def fb_results(out: types.ForwardBackwardOutput, calls: Sequence[Sequence[Datum]]) -> list[ForwardBackwardResult]:
    """One merged request's result, handed back per call: each call's own datums' logprobs, and
    the request's metrics (a ``loss:sum`` is the whole request's)."""
    whole = fb_result(out, [d for datums in calls for d in datums])
    results, start = [], 0
    for datums in calls:
        rows = whole.logprobs_D[start : start + len(datums)]
        start += len(datums)
        metrics = whole.metrics | {"loss_tokens": float(sum(d.num_loss_tokens for d in datums))}
        results.append(ForwardBackwardResult(logprobs_D=rows, metrics=metrics))
    return results


def optim_result(out: types.OptimStepResponse) -> OptimResult:
    return OptimResult(metrics=metrics(out.metrics))


def adam(params: AdamParams) -> types.AdamParams:
    return types.AdamParams(
        learning_rate=params.learning_rate,
        beta1=params.beta1,
        beta2=params.beta2,
        eps=params.eps,
        weight_decay=params.weight_decay,
        grad_clip_norm=params.grad_clip_norm,
    )


def sampling_params(params: SamplingParams, eos_token_id: int) -> types.SamplingParams:
    # Tinker's ``stop`` replaces the default EOS stop, so EOS goes in with any explicit stops
    stop = sorted({*params.stop_token_ids, eos_token_id}) if params.stop_token_ids else None
    return types.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop=stop,
    )


def sampled(response: types.SampleResponse) -> list[SampledTokens]:
    out = []
    for seq in response.sequences:
        if seq.logprobs is None:
            raise ValueError("Tinker returned a sample without logprobs; headrace needs the sampler's own logprobs")
        reason = StopReason.STOP if seq.stop_reason == "stop" else StopReason.LENGTH
        out.append(
            SampledTokens(
                tokens=[int(t) for t in seq.tokens], logprobs=[float(x) for x in seq.logprobs], stop_reason=reason
            )
        )
    return out

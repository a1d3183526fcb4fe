"""headrace types ↔ Tinker SDK types. Token ids and logprobs pass through as numbers: nothing
is ever decoded and re-encoded."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from tinker import types

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

CLIPPED_LOSSES = ("ppo", "cispo")


def to_datum(d: Datum, loss: LossSpec) -> types.Datum:
    """``cross_entropy`` takes ``weights`` (the mask); the policy losses take the sampler's
    logprobs and the advantages, zeroed off the mask (Tinker has no mask input)."""
    mask = np.asarray(d.mask, dtype=np.float32)
    inputs: dict[str, Any] = {"target_tokens": types.TensorData.from_numpy(np.asarray(d.target_tokens, dtype=np.int64))}
    if loss.name == "cross_entropy":
        inputs["weights"] = types.TensorData.from_numpy(mask)
    else:
        logprobs = np.asarray(d.logprobs, dtype=np.float32) * mask
        advantages = np.asarray(d.advantages, dtype=np.float32) * mask
        inputs["logprobs"] = types.TensorData.from_numpy(logprobs)
        inputs["advantages"] = types.TensorData.from_numpy(advantages)
    return types.Datum(model_input=types.ModelInput.from_ints(list(d.model_input)), loss_fn_inputs=inputs)


def loss_config(loss: LossSpec) -> dict[str, float] | None:
    if loss.name in CLIPPED_LOSSES:
        return {
            k: float(v) for k, v in loss.config.items() if k in ("clip_low_threshold", "clip_high_threshold")
        } or None
    return None


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
    result = metrics(out.metrics)
    result["loss_tokens"] = float(sum(d.num_loss_tokens for d in datums))
    return ForwardBackwardResult(logprobs_D=logprobs_D, metrics=result)


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

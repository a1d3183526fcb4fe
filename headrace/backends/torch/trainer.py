"""The training backend: forward/backward with a named loss, AdamW, publish, checkpoints.

Every call is queued on the device thread and returns an already-submitted asyncio future.

Loss normalisation: ``forward_backward`` back-propagates the loss *summed* over its loss
tokens (mask = 1) and counts them; ``optim_step`` divides the accumulated gradient by the
number of loss tokens since the previous step before clipping and applying it. The update is
therefore the per-token mean over the whole step, identical however the step was split into
``forward_backward`` calls (sync or stream schedulers alike), and its scale does not grow with
batch size or answer length. The returned ``optim/loss`` is that call's per-token mean.
``loss.aggregation`` changes the weights and the divisor: ``sequence_mean`` weighs each token
1/(its sequence's loss tokens) and divides by the step's sequences (GRPO's original mean of
means, which gives a short answer's tokens more weight); ``dr_grpo`` sums the tokens and divides by
the step's sequences x ``loss.normalizer`` (Dr.GRPO: no per-sequence length normalisation, and a
divisor that does not move with the step's total length).

Reference KL (``loss.kl_coef > 0``): the frozen reference of ``scoring.py`` (the base with the
adapter disabled for LoRA, the initial weights rebuilt for full fine-tuning); nothing is built or
run when kl_coef is 0.

The parts: ``scoring.py`` computes the targets' logprobs (the LM head at the loss positions only,
microbatches by tokens, the reference), ``batches.py`` lays datums out in tensors (padded, or
packed for ``cross_entropy``: ``torch.pack``), ``custom.py`` holds post-training's forward and
custom-loss calls, ``flops.py`` counts a pass's FLOPs. This file is the protocol: the loss step,
the optimizer step, publishing and checkpoints.

Non-finite updates: a step whose loss (any ``forward_backward`` since the previous step) or
gradient norm is NaN or infinite is skipped, as mixed-precision loss scalers do: its gradient is
dropped, the weights and the optimizer state stay untouched, and the step reports
``optim/skipped_nonfinite = 1`` (0 otherwise). ``max_nonfinite_skips`` such steps in a row stop
the run (``NonFiniteError``): data or weights that keep producing them will not recover alone.
A checkpoint is never written from weights holding a NaN or an infinity.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headrace.core import logs
from headrace.core.advantages import NonFiniteError
from headrace.core.errors import ConfigError
from headrace.core.protocols import GradientSum
from headrace.core.types import AdamParams, Datum, ForwardBackwardResult, LossSpec, OptimResult, SamplerHandle

from .batches import rows_of
from .checkpoint import delete as delete_checkpoint
from .checkpoint import load as load_checkpoint
from .checkpoint import save as save_checkpoint
from .custom import forward_backward_custom, score
from .device_thread import DeviceThread
from .flops import ModelShape, PerfMeter, train_flops
from .fork import trainable_copy
from .losses import check, get_loss, token_weights
from .scoring import Scorer
from .weights import PublishedWeights, snapshot

log = logs.get_logger()

# losses that read each token alone: a packed row (several datums) computes them as padded rows do
PACKABLE = {"cross_entropy"}


class TorchTrainer:
    def __init__(
        self,
        model: nn.Module,
        params: dict[str, nn.Parameter],
        device_thread: DeviceThread,
        device: torch.device,
        pad_token_id: int,
        adam: AdamParams,
        checkpoint_dir: Path,
        publisher: Callable[[int, dict[str, torch.Tensor]], PublishedWeights],
        microbatch_size: int = 0,
        identity: dict[str, Any] | None = None,
        max_nonfinite_skips: int = 3,
        extra_state: Callable[[], dict[str, Any]] = dict,
        restore_extra: Callable[[dict[str, Any]], None] = lambda state: None,
        reference_model: Callable[[], nn.Module] | None = None,
        gradient_sum: GradientSum | None = None,
        meter: PerfMeter | None = None,
        pack: bool = True,
        share_prefix: bool = True,
    ):
        self.model = model
        self.meter = meter  # FLOPs and seconds per phase: perf/… in the optim step's metrics
        self._shape = ModelShape.of(model) if meter is not None else None
        self.params = params
        self.device = device
        self.pad_token_id = pad_token_id
        self.checkpoint_dir = checkpoint_dir
        self.scorer = Scorer(model, device, pad_token_id, microbatch_size, reference_model, share_prefix)
        self.pack = pack  # cross_entropy's datums packed into rows (torch.pack)
        self._device_thread = device_thread
        self._publisher = publisher
        self._identity = identity or {}  # header fields a checkpoint must match to be loaded
        # float32 master copies of trainable weights kept in a lower precision (full fine-tuning in
        # bfloat16): the optimizer, its moments and checkpoints work on these; the model's copy is
        # refreshed from them after each step. LoRA's adapters are float32 already (PEFT's autocast).
        self._masters = {
            n: nn.Parameter(p.detach().float().clone())
            for n, p in params.items()
            if p.is_floating_point() and p.dtype != torch.float32
        }
        self._optimized = {n: self._masters.get(n, p) for n, p in params.items()}
        self.optimizer = torch.optim.AdamW(
            list(self._optimized.values()),
            lr=adam.learning_rate,
            betas=(adam.beta1, adam.beta2),
            eps=adam.eps,
            weight_decay=adam.weight_decay,
        )
        self.loss_tokens = 0  # loss tokens accumulated since the last optimizer step
        self.loss_norm = 0.0  # what the step's summed gradient is divided by (loss.aggregation)
        self.loss_finite = True  # every loss since the last optimizer step was finite
        self.optim_steps = 0
        self.max_nonfinite_skips = max_nonfinite_skips
        self.nonfinite_in_a_row = 0
        # the backend adds what else a checkpoint must carry (the sampler's seed stream)
        self.extra_state, self.restore_extra = extra_state, restore_extra
        # data-parallel ranks (--cluster ray): (grads, tokens, norm, loss_finite) -> the totals over
        # every rank, the grads summed in place; every rank must then take the same step
        self.gradient_sum = gradient_sum

    # ---- the protocol: submit now, resolve later ----

    def forward_backward(self, datums: Sequence[Datum], loss: LossSpec) -> asyncio.Future[ForwardBackwardResult]:
        if self.meter is None:
            return self._device_thread.submit(self._forward_backward, list(datums), loss)
        return self._device_thread.submit(
            self.meter.timed("train", functools.partial(self._forward_backward, list(datums), loss))
        )

    def forward(self, datums: Sequence[Datum]) -> asyncio.Future[list[list[float]]]:
        """Each datum's target logprobs under the current weights, without a gradient (``ComputesCustomLoss``)."""
        return self._device_thread.submit(self._forward, list(datums), False)

    def reference_logprobs(self, datums: Sequence[Datum]) -> asyncio.Future[list[list[float]]]:
        """The same under the frozen reference ``loss.kl_coef`` uses (``ScoresReference``): the base
        with the adapter off for LoRA, the initial weights rebuilt for full fine-tuning."""
        return self._device_thread.submit(self._forward, list(datums), True)

    def forward_backward_custom(self, datums: Sequence[Datum], loss_fn: Any) -> asyncio.Future[ForwardBackwardResult]:
        """``loss_fn(datums, logprobs)`` over each datum's target logprobs (with their gradient at
        the datum's mask != 0 positions), back-propagated as it stands (``ComputesCustomLoss``)."""
        return self._device_thread.submit(self._forward_backward_custom, list(datums), loss_fn)

    def check_loss(self, loss: LossSpec) -> None:
        """Refuse, before the run starts, a loss this trainer cannot compute (``ConfigError``)."""
        try:
            check(loss.name, loss.config)
        except ValueError as e:
            raise ConfigError(f"the torch backend cannot train with loss '{loss.name}': {e}.") from None
        if float(loss.config.get("kl_coef", 0.0)) > 0 and not self._has_reference():
            raise ConfigError(
                "loss.kl_coef > 0 needs a frozen reference model, and this torch trainer has neither a LoRA adapter "
                "to disable nor a way to rebuild the initial weights; set loss.kl_coef=0."
            )

    def _has_reference(self) -> bool:
        return self.scorer.has_reference()

    def optim_step(self, adam: AdamParams) -> asyncio.Future[OptimResult]:
        return self._device_thread.submit(self._optim_step, adam)

    def publish(self, version: int) -> asyncio.Future[SamplerHandle]:
        return self._device_thread.submit(self._publish, version)

    async def save_state(self, name: str) -> str:
        return await self._device_thread.submit(self._save, name)

    async def load_state(self, path: str) -> None:
        await self._device_thread.submit(self._load, path)

    async def fork(self) -> TorchTrainer:
        """A separate training state from these weights and this Adam state (``headrace serve``'s
        candidates): it shares what never trains (``fork.py``) and copies what does, so training
        it never changes this one, and a rejected one is dropped by letting go of it."""
        return await self._device_thread.submit(self._twin)

    async def close(self) -> None:
        """A fork no longer used: nothing to release but the references the caller drops."""

    async def delete_state(self, path: str) -> None:
        """Remove a checkpoint the run no longer keeps (``checkpoint.keep_last``), off the device thread."""
        await asyncio.to_thread(delete_checkpoint, Path(path), self.checkpoint_dir)

    # ---- device thread ----

    def _twin(self) -> TorchTrainer:
        """Runs on the device thread, between calls: no gradient is pending there."""
        model, params = trainable_copy(self.model, self.params)
        twin = TorchTrainer(
            model,
            params,
            self._device_thread,
            self.device,
            self.pad_token_id,
            AdamParams(),  # placeholders, as for the first trainer: each optim_step brings the settings
            self.checkpoint_dir,
            self._publisher,
            microbatch_size=self.scorer.microbatch_size,
            identity=self._identity,
            max_nonfinite_skips=self.max_nonfinite_skips,
            extra_state=self.extra_state,
            restore_extra=self.restore_extra,
            reference_model=self.scorer.reference_model,
            gradient_sum=self.gradient_sum,
            pack=self.pack,
            share_prefix=self.scorer.share_prefix,
        )
        # parameters are listed in the same order in both models, which is how Adam's state is keyed
        twin.optimizer.load_state_dict(copy.deepcopy(self.optimizer.state_dict()))
        with torch.no_grad():  # and the float32 masters, not a copy rounded from the model's weights
            for name, master in twin._masters.items():
                master.copy_(self._masters[name])
        twin.optim_steps, twin.scorer.reference = self.optim_steps, self.scorer.reference  # the frozen one, shared
        return twin

    def _forward_backward(self, datums: list[Datum], loss: LossSpec) -> ForwardBackwardResult:
        check(loss.name, loss.config)  # an unknown name or a bad option fails before any work
        loss_fn, config = get_loss(loss.name), loss.config
        aggregation = str(config.get("aggregation", "token_mean"))
        kl_coef = float(config.get("kl_coef", 0.0))
        logprobs_D: list[list[float]] = [[] for _ in datums]
        sums = {"loss": 0.0, "ratio": 0.0, "clipped": 0.0, "masked": 0.0, "kl_ref": 0.0, "kl": 0.0, "tokens": 0.0}
        norm = 0.0
        extremes: dict[str, list[float]] = {"ratio_max": [], "ratio_min": []}
        packed = self.pack and loss.name in PACKABLE and aggregation == "token_mean"
        for idx, batch in self.scorer.batches(datums, packed):
            mask = batch["mask"]
            weight, part = token_weights(aggregation, mask, config)
            norm += part
            ref = self.scorer.reference_logprobs(batch) if kl_coef > 0 and bool((mask != 0).any()) else None
            with torch.set_grad_enabled(bool((mask != 0).any())):  # no loss token: a forward only, no graph
                logp = self.scorer.target_logprobs(batch)
                total, stats = loss_fn(logp, batch["logprobs"], batch["advantages"], mask, config, weight, ref)
            if total.requires_grad:
                total.backward()
            with torch.no_grad():
                sums["loss"] += float(total.detach())
                sums["kl"] += float(((batch["logprobs"] - logp) * mask).sum())
                for k, v in stats.items():
                    if k in extremes:
                        extremes[k].append(float(v))
                    else:
                        sums[k] += float(v)
            if self.meter is not None and self._shape is not None:
                flops, tokens = train_flops(self._shape, batch, total.requires_grad, self.scorer.body is None)
                self.meter.add("train", flops=flops, tokens=tokens)
            for i, row in zip(idx, rows_of(logp.detach().to("cpu").tolist(), batch), strict=True):
                logprobs_D[i] = row
        self.loss_tokens += int(sums["tokens"])
        self.loss_norm += norm
        self.loss_finite = self.loss_finite and math.isfinite(sums["loss"])
        n = max(sums["tokens"], 1.0)
        metrics = {
            "optim/loss": sums["loss"] / norm if norm > 0 else 0.0,  # as the step's update weighs it
            "optim/loss_tokens:sum": sums["tokens"],  # the engine sums ":sum" keys over minibatches
            "optim/kl_sampler_learner": sums["kl"] / n,  # k1 estimate of KL(sampler || learner)
            # the importance ratio learner/sampler per loss token, and what the loss did with it
            "loss/ratio_mean": sums["ratio"] / n,
            "loss/clipped_frac": sums["clipped"] / n,
            "loss/masked_frac": sums["masked"] / n,
        }
        if extremes["ratio_max"]:
            metrics["loss/ratio_max:max"] = max(extremes["ratio_max"])
            metrics["loss/ratio_min:min"] = min(extremes["ratio_min"])
        if kl_coef > 0:
            metrics["loss/kl"] = sums["kl_ref"] / n  # loss.kl_estimator's estimate of KL(learner || reference)
        return ForwardBackwardResult(logprobs_D=logprobs_D, metrics=metrics)

    def _forward(self, datums: list[Datum], reference: bool) -> list[list[float]]:
        return score(self.scorer, datums, reference)

    def _forward_backward_custom(self, datums: list[Datum], loss_fn: Any) -> ForwardBackwardResult:
        value, tokens, logprobs, metrics = forward_backward_custom(self.scorer, datums, loss_fn)
        self.loss_tokens += tokens
        self.loss_norm += 1.0  # applied as it stands: the custom loss is already the step's scale
        self.loss_finite = self.loss_finite and math.isfinite(value)
        return ForwardBackwardResult(
            logprobs_D=logprobs, metrics={"optim/loss": value, "optim/loss_tokens:sum": float(tokens), **metrics}
        )

    def _optim_step(self, adam: AdamParams) -> OptimResult:
        result = self._step(adam)
        if self.meter is not None:  # the phases' FLOPs and seconds since the last step: this row's perf/…
            result.metrics.update(self.meter.drain())
        return result

    def _step(self, adam: AdamParams) -> OptimResult:
        for group in self.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay
            )
        tokens, self.loss_tokens = self.loss_tokens, 0
        norm, self.loss_norm = self.loss_norm, 0.0
        loss_finite, self.loss_finite = self.loss_finite, True
        if self.gradient_sum is not None:
            # every rank reduces the same list: a parameter this rank left without a gradient adds zeros
            for p in self.params.values():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            all_grads = [p.grad for p in self.params.values() if p.grad is not None]
            total, norm, loss_finite = self.gradient_sum(all_grads, tokens, norm, loss_finite)
            tokens = int(total)
        for name, master in self._masters.items():  # the gradient, in float32, onto the master copy
            p = self.params[name]
            master.grad, p.grad = (None if p.grad is None else p.grad.float()), None
        grads = [p for p in self._optimized.values() if p.grad is not None]
        if tokens == 0 or norm <= 0 or not grads:
            self.optimizer.zero_grad(set_to_none=True)
            return OptimResult({"optim/skipped": 1.0, "optim/lr": adam.learning_rate})
        with torch.no_grad():
            for p in grads:
                assert p.grad is not None  # grads holds only those
                p.grad.div_(norm)
        max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, max_norm))
        metrics = {"optim/grad_norm": grad_norm, "optim/lr": adam.learning_rate, "optim/step_tokens": float(tokens)}
        if not (loss_finite and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            self._skip_nonfinite("loss" if not loss_finite else f"gradient norm ({grad_norm})")
            return OptimResult(metrics | {"optim/skipped_nonfinite": 1.0})
        self.nonfinite_in_a_row = 0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._refresh_from_masters()
        self.optim_steps += 1
        return OptimResult(metrics | {"optim/skipped_nonfinite": 0.0})

    def _refresh_from_masters(self) -> None:
        with torch.no_grad():
            for name, master in self._masters.items():
                self.params[name].copy_(master)

    def _skip_nonfinite(self, what: str) -> None:
        self.nonfinite_in_a_row += 1
        log.warning("nonfinite_update_skipped", what=what, in_a_row=self.nonfinite_in_a_row, applied=self.optim_steps)
        if self.nonfinite_in_a_row >= self.max_nonfinite_skips:
            raise NonFiniteError(
                f"{self.nonfinite_in_a_row} optimizer steps in a row had a non-finite {what} and were skipped; the "
                f"weights are those of optimizer step {self.optim_steps}, untouched since. Look for rewards or "
                "advantages of extreme scale (advantages.normalize_std), lower optim.learning_rate, use "
                "torch.dtype = float32, or allow more skips in a row with torch.max_nonfinite_skips."
            )

    def _publish(self, version: int) -> SamplerHandle:
        return SamplerHandle(version=version, ref=self._publisher(version, snapshot(self.params)))

    def _save(self, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name) or name.startswith("."):
            raise ValueError(f"checkpoint name '{name}' must be a plain file name (letters, digits, . _ -)")
        finite = torch.stack([torch.isfinite(p.detach()).all() for p in self.params.values()])
        if not bool(finite.all()):
            bad = next(n for n, ok in zip(self.params, finite.tolist(), strict=True) if not ok)
            raise NonFiniteError(
                f"refusing to save checkpoint '{name}': weight '{bad}' holds NaN or infinite values. The previous "
                "checkpoints are untouched; resume from the latest one, with a lower optim.learning_rate."
            )
        meta = {
            **self._identity,
            "optim_steps": self.optim_steps,
            "pending_loss_tokens": self.loss_tokens,
            "extra": self.extra_state(),
        }
        # the master copies where there are some: a resumed run continues from float32 weights
        return str(save_checkpoint(self.checkpoint_dir / name, self._optimized, self.optimizer, meta))

    def _load(self, path: str) -> None:
        meta = load_checkpoint(Path(path), self._optimized, self.optimizer, self._identity)
        self._refresh_from_masters()
        self.optim_steps = int(meta.get("optim_steps", 0))
        self.loss_tokens, self.loss_norm = 0, 0.0
        self.optimizer.zero_grad(set_to_none=True)
        self.restore_extra(meta.get("extra", {}))

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

Reference KL (``loss.kl_coef > 0``): the frozen reference is the base model with the LoRA
adapter disabled (peft's ``disable_adapter()``), or for full fine-tuning a copy of the initial
weights built by ``reference_model`` on first use; nothing is built or run when kl_coef is 0.

Memory: the LM head runs only where the loss reads it (mask != 0) with a gradient; every
other position's logprob (``logprobs_D`` holds them all: Tinker's forward returns them) is computed
without one. Microbatches hold a token budget, not a datum count.

Non-finite updates: a step whose loss (any ``forward_backward`` since the previous step) or
gradient norm is NaN or infinite is skipped, as mixed-precision loss scalers do: its gradient is
dropped, the weights and the optimizer state stay untouched, and the step reports
``optim/skipped_nonfinite = 1`` (0 otherwise). ``max_nonfinite_skips`` such steps in a row stop
the run (``NonFiniteError``): data or weights that keep producing them will not recover alone.
A checkpoint is never written from weights holding a NaN or an infinity.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import math
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headrace.core import logs
from headrace.core.advantages import NonFiniteError
from headrace.core.errors import ConfigError
from headrace.core.protocols import GradientSum
from headrace.core.types import AdamParams, Datum, ForwardBackwardResult, LossSpec, OptimResult, SamplerHandle

from .checkpoint import delete as delete_checkpoint
from .checkpoint import load as load_checkpoint
from .checkpoint import save as save_checkpoint
from .device_thread import DeviceThread
from .flops import ModelShape, PerfMeter, causal_pairs
from .fork import trainable_copy
from .losses import check, get_loss, token_weights
from .model import body_and_head
from .weights import PublishedWeights, snapshot

# torch.microbatch_size = 0 sizes microbatches by tokens. The body's saved activations dominate
# memory (about 3 MB a token on SmolLM2-135M, in proportion to hidden size x layers), so a pass
# holds at most ACTIVATION_BUDGET // (hidden x layers) padded tokens: 485 on SmolLM2 (peak RSS
# 2.8 GB for 64 x 66 tokens with LoRA, as fast as 2048 tokens a pass at 4.5x the memory), the
# whole batch on the tiny model. LOGITS_BUDGET caps loss-position logits (256 MiB in fp32).
ACTIVATION_BUDGET = 1 << 23
MIN_MICROBATCH_TOKENS = 128
LOGITS_BUDGET = 1 << 26

log = logs.get_logger()


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
    ):
        self.model = model
        self.meter = meter  # FLOPs and seconds per phase: perf/… in the optim step's metrics
        self._shape = ModelShape.of(model) if meter is not None else None
        self.params = params
        self.device = device
        self.pad_token_id = pad_token_id
        self.checkpoint_dir = checkpoint_dir
        self.microbatch_size = microbatch_size
        self.vocab_size = int(getattr(model.config, "vocab_size", 0) or 0)
        self._body, self._head = body_and_head(model)
        width = math.prod(int(getattr(model.config, k, 0) or 0) for k in ("hidden_size", "num_hidden_layers"))
        self.microbatch_tokens = max(MIN_MICROBATCH_TOKENS, ACTIVATION_BUDGET // max(width, 1))
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
        # full fine-tuning: builds the frozen reference (the initial weights) when kl_coef > 0
        self.reference_model = reference_model
        self._reference: tuple[nn.Module, Any, Any] | None = None
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
        return hasattr(self.model, "disable_adapter") or self.reference_model is not None

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
            microbatch_size=self.microbatch_size,
            identity=self._identity,
            max_nonfinite_skips=self.max_nonfinite_skips,
            extra_state=self.extra_state,
            restore_extra=self.restore_extra,
            reference_model=self.reference_model,
            gradient_sum=self.gradient_sum,
        )
        # parameters are listed in the same order in both models, which is how Adam's state is keyed
        twin.optimizer.load_state_dict(copy.deepcopy(self.optimizer.state_dict()))
        with torch.no_grad():  # and the float32 masters, not a copy rounded from the model's weights
            for name, master in twin._masters.items():
                master.copy_(self._masters[name])
        twin.optim_steps, twin._reference = self.optim_steps, self._reference  # the frozen reference is shared
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
        for idx in self._microbatches(datums):
            batch = _pad([datums[i] for i in idx], self.pad_token_id, self.device)
            mask = batch["mask"]
            weight, part = token_weights(aggregation, mask, config)
            norm += part
            ref = self._reference_logprobs(batch) if kl_coef > 0 and bool((mask != 0).any()) else None
            with torch.set_grad_enabled(bool((mask != 0).any())):  # no loss token: a forward only, no graph
                logp = self._target_logprobs(batch)
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
            values = logp.detach().to("cpu").tolist()
            if self.meter is not None:
                self._count_flops(batch, total.requires_grad)
            for row, i in enumerate(idx):
                logprobs_D[i] = values[row][: len(datums[i].model_input)]
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

    def _count_flops(self, batch: dict[str, torch.Tensor], backward: bool) -> None:
        assert self.meter is not None and self._shape is not None
        rows, length = batch["input"].shape
        tokens, pairs = rows * length, causal_pairs(rows, length)
        loss_rows = int((batch["mask"] != 0).sum())
        head_rows = int(batch["real"].sum()) if self._body is not None else tokens  # the head runs where needed
        flops = self._shape.forward(tokens, pairs, head_rows)
        if backward:
            flops += self._shape.backward(tokens, pairs, loss_rows)
        self.meter.add("train", flops=flops, tokens=tokens)

    def _reference_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[rows, time]`` logprobs of the targets under the frozen reference, at the loss
        positions (0 elsewhere), without a gradient."""
        disable_adapter = getattr(self.model, "disable_adapter", None)  # peft: the base model itself
        if disable_adapter is not None:
            model, body, head = self.model, self._body, self._head
            context: Any = disable_adapter()
        else:
            model, body, head = self._reference_parts()
            context = contextlib.nullcontext()
        with torch.no_grad(), context:
            target, loss_at = batch["target"], batch["mask"] != 0
            if body is None:
                logits = model(input_ids=batch["input"]).logits.float()
                logp = logits.log_softmax(-1).gather(-1, target[..., None]).squeeze(-1)
                return torch.where(loss_at, logp, torch.zeros_like(logp))
            hidden = body(input_ids=batch["input"]).last_hidden_state
            out = torch.zeros(target.shape, dtype=torch.float32, device=target.device)
            at = head(hidden[loss_at]).float().log_softmax(-1).gather(-1, target[loss_at][:, None]).squeeze(-1)
            return out.masked_scatter(loss_at, at)

    def _reference_parts(self) -> tuple[nn.Module, Any, Any]:
        if self._reference is None:
            if self.reference_model is None:
                raise ValueError(
                    "loss.kl_coef > 0 needs a frozen reference model, and this trainer has neither a LoRA adapter to "
                    "disable nor a way to rebuild the initial weights (reference_model); set loss.kl_coef=0"
                )
            ref = self.reference_model().to(self.device)
            ref.eval()
            ref.requires_grad_(False)
            body, head = body_and_head(ref)
            self._reference = (ref, body, head)
            log.info("reference_model_built", params=sum(p.numel() for p in ref.parameters()))
        return self._reference

    def _microbatches(self, datums: list[Datum]) -> Iterator[list[int]]:
        """Datum indices per forward pass, longest first so each pads to similar lengths."""
        order = sorted(range(len(datums)), key=lambda i: -len(datums[i].model_input))
        if self.microbatch_size:
            for start in range(0, len(order), self.microbatch_size):
                yield order[start : start + self.microbatch_size]
            return
        max_loss_tokens = LOGITS_BUDGET // max(self.vocab_size, 1)
        chunk: list[int] = []
        loss_tokens = 0
        for i in order:
            n_loss = sum(1 for m in datums[i].mask if m != 0)
            padded = (len(chunk) + 1) * len(datums[chunk[0]].model_input) if chunk else 0  # chunk[0] is its longest
            if chunk and (padded > self.microbatch_tokens or loss_tokens + n_loss > max_loss_tokens):
                yield chunk
                chunk, loss_tokens = [], 0
            chunk.append(i)
            loss_tokens += n_loss
        if chunk:
            yield chunk

    def _target_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[rows, time]`` logprobs of the targets. The LM head runs on the hidden states of the
        loss positions (mask != 0) only, so full-vocabulary logits with a gradient exist for those
        alone; every other position gets its logprob without a gradient, a chunk at a time."""
        if self._body is None:  # a head this code cannot call alone: the model's own forward
            logits = self.model(input_ids=batch["input"]).logits.float()
            return logits.log_softmax(-1).gather(-1, batch["target"][..., None]).squeeze(-1)
        hidden = self._body(input_ids=batch["input"]).last_hidden_state
        target, loss_at = batch["target"], batch["mask"] != 0
        logp = torch.zeros(target.shape, dtype=torch.float32, device=target.device)
        logp = logp.masked_scatter(loss_at, self._head_logprobs(hidden[loss_at], target[loss_at]))
        rows, cols = (~loss_at & batch["real"]).nonzero(as_tuple=True)  # padding needs none
        step = max(1, LOGITS_BUDGET // max(self.vocab_size, 1))
        rest = []
        with torch.no_grad():
            for s in range(0, len(rows), step):
                r, c = rows[s : s + step], cols[s : s + step]
                rest.append(self._head_logprobs(hidden[r, c], target[r, c]))
        return logp.index_put((rows, cols), torch.cat(rest)) if rest else logp

    def _head_logprobs(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._head(hidden).float().log_softmax(-1).gather(-1, target[:, None]).squeeze(-1)

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


def _pad(datums: list[Datum], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded batch tensors; padding has mask 0, so it never reaches the loss."""
    longest = max(len(d.model_input) for d in datums)

    def tensor(rows: list[list[Any]], fill: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([r + [fill] * (longest - len(r)) for r in rows], dtype=dtype).to(device)

    return {
        "input": tensor([list(d.model_input) for d in datums], pad_id, torch.long),
        "target": tensor([list(d.target_tokens) for d in datums], 0, torch.long),
        "logprobs": tensor([list(d.logprobs) for d in datums], 0.0, torch.float32),
        "advantages": tensor([list(d.advantages) for d in datums], 0.0, torch.float32),
        "mask": tensor([list(d.mask) for d in datums], 0.0, torch.float32),
        "real": tensor([[True] * len(d.model_input) for d in datums], False, torch.bool),
    }

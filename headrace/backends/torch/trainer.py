"""The training backend: forward/backward with a named loss, AdamW, publish, checkpoints.

Every call is queued on the device thread and returns an already-submitted asyncio future.

Loss normalisation: ``forward_backward`` back-propagates the loss *summed* over its loss
tokens (mask = 1) and counts them; ``optim_step`` divides the accumulated gradient by the
number of loss tokens since the previous step before clipping and applying it. The update is
therefore the per-token mean over the whole step, identical however the step was split into
``forward_backward`` calls (sync or stream schedulers alike), and its scale does not grow with
batch size or answer length. The returned ``optim/loss`` is that call's per-token mean.

Non-finite updates: a step whose loss (any ``forward_backward`` since the previous step) or
gradient norm is NaN or infinite is skipped, as mixed-precision loss scalers do: its gradient is
dropped, the weights and the optimizer state stay untouched, and the step reports
``optim/skipped_nonfinite = 1`` (0 otherwise). ``max_nonfinite_skips`` such steps in a row stop
the run (``NonFiniteError``): data or weights that keep producing them will not recover alone.
A checkpoint is never written from weights holding a NaN or an infinity.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headrace.engine import logs
from headrace.engine.advantages import NonFiniteError
from headrace.engine.types import AdamParams, Datum, ForwardBackwardResult, LossSpec, OptimResult, SamplerHandle

from . import checkpoint
from .device_thread import DeviceThread
from .losses import get_loss
from .weights import PublishedWeights, snapshot

# elements of one microbatch's [batch, time, vocab] logits when torch.microbatch_size = 0:
# 1 GiB in fp32, so a 150k-token vocabulary does not need the whole batch's logits at once
LOGITS_BUDGET = 1 << 28

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
    ):
        self.model = model
        self.params = params
        self.device = device
        self.pad_token_id = pad_token_id
        self.checkpoint_dir = checkpoint_dir
        self.microbatch_size = microbatch_size
        self.vocab_size = int(getattr(model.config, "vocab_size", 0) or 0)
        self._device_thread = device_thread
        self._publisher = publisher
        self._identity = identity or {}  # header fields a checkpoint must match to be loaded
        self.optimizer = torch.optim.AdamW(
            list(params.values()),
            lr=adam.learning_rate,
            betas=(adam.beta1, adam.beta2),
            eps=adam.eps,
            weight_decay=adam.weight_decay,
        )
        self.loss_tokens = 0  # loss tokens accumulated since the last optimizer step
        self.loss_finite = True  # every loss since the last optimizer step was finite
        self.optim_steps = 0
        self.max_nonfinite_skips = max_nonfinite_skips
        self.nonfinite_in_a_row = 0
        # the backend adds what else a checkpoint must carry (the sampler's seed stream)
        self.extra_state: Callable[[], dict[str, Any]] = dict
        self.restore_extra: Callable[[dict[str, Any]], None] = lambda state: None

    # ---- the protocol: submit now, resolve later ----

    def forward_backward(self, datums: Sequence[Datum], loss: LossSpec) -> asyncio.Future[ForwardBackwardResult]:
        return self._device_thread.submit(self._forward_backward, list(datums), loss)

    def optim_step(self, adam: AdamParams) -> asyncio.Future[OptimResult]:
        return self._device_thread.submit(self._optim_step, adam)

    def publish(self, version: int) -> asyncio.Future[SamplerHandle]:
        return self._device_thread.submit(self._publish, version)

    async def save_state(self, name: str) -> str:
        return await self._device_thread.submit(self._save, name)

    async def load_state(self, path: str) -> None:
        await self._device_thread.submit(self._load, path)

    async def delete_state(self, path: str) -> None:
        """Remove a checkpoint the run no longer keeps (``checkpoint.keep_last``), off the device thread."""
        await asyncio.to_thread(checkpoint.delete, Path(path), self.checkpoint_dir)

    # ---- device thread ----

    def _forward_backward(self, datums: list[Datum], loss: LossSpec) -> ForwardBackwardResult:
        loss_fn = get_loss(loss.name)
        logprobs_D: list[list[float]] = [[] for _ in datums]
        sums = {"loss": 0.0, "ratio": 0.0, "clipped": 0.0, "kl": 0.0, "tokens": 0.0}
        # longest first, so each microbatch pads to similar lengths
        order = sorted(range(len(datums)), key=lambda i: -len(datums[i].model_input))
        start = 0
        while start < len(order):
            longest = len(datums[order[start]].model_input)
            size = self.microbatch_size or max(1, LOGITS_BUDGET // max(longest * self.vocab_size, 1))
            idx = order[start : start + size]
            start += size
            batch = _pad([datums[i] for i in idx], self.pad_token_id, self.device)
            logits = self.model(input_ids=batch["input"]).logits.float()
            logp = logits.log_softmax(-1).gather(-1, batch["target"][..., None]).squeeze(-1)
            mask = batch["mask"]
            total, stats = loss_fn(logp, batch["logprobs"], batch["advantages"], mask, loss.config)
            if total.requires_grad:
                total.backward()
            with torch.no_grad():
                sums["loss"] += float(total.detach())
                sums["tokens"] += float(mask.sum())
                sums["kl"] += float(((batch["logprobs"] - logp) * mask).sum())
                for k, v in stats.items():
                    sums[k] += float(v)
            values = logp.detach().to("cpu").tolist()
            for row, i in enumerate(idx):
                logprobs_D[i] = values[row][: len(datums[i].model_input)]
        self.loss_tokens += int(sums["tokens"])
        self.loss_finite = self.loss_finite and math.isfinite(sums["loss"])
        n = max(sums["tokens"], 1.0)
        metrics = {
            "optim/loss": sums["loss"] / n,
            "optim/loss_tokens:sum": sums["tokens"],  # the engine sums ":sum" keys over minibatches
            "optim/ratio_mean": sums["ratio"] / n,
            "optim/kl_sampler_learner": sums["kl"] / n,  # k1 estimate of KL(sampler || learner)
        }
        if loss.name in ("ppo", "cispo"):
            metrics["optim/clip_frac"] = sums["clipped"] / n
        return ForwardBackwardResult(logprobs_D=logprobs_D, metrics=metrics)

    def _optim_step(self, adam: AdamParams) -> OptimResult:
        for group in self.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay
            )
        tokens, self.loss_tokens = self.loss_tokens, 0
        loss_finite, self.loss_finite = self.loss_finite, True
        grads = [p for p in self.params.values() if p.grad is not None]
        if tokens == 0 or not grads:
            self.optimizer.zero_grad(set_to_none=True)
            return OptimResult({"optim/skipped": 1.0, "optim/lr": adam.learning_rate})
        with torch.no_grad():
            for p in grads:
                p.grad.div_(tokens)
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
        self.optim_steps += 1
        return OptimResult(metrics | {"optim/skipped_nonfinite": 0.0})

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
        meta = {**self._identity, "optim_steps": self.optim_steps, "pending_loss_tokens": self.loss_tokens,
                "extra": self.extra_state()}
        return str(checkpoint.save(self.checkpoint_dir / name, self.params, self.optimizer, meta))

    def _load(self, path: str) -> None:
        meta = checkpoint.load(Path(path), self.params, self.optimizer, self._identity)
        self.optim_steps = int(meta.get("optim_steps", 0))
        self.loss_tokens = 0
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
    }

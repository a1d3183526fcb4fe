"""The emulator's real compute: one headrace ``torch`` backend (the served base model with a
LoRA adapter) per Tinker training client. The base models are ``--model`` names resolved by
headrace's model registry (``headrace/models``): the embedded ``tiny``, ``smollm2-135m``, a model
directory or a ``.gguf`` file.

Tinker's inputs map onto headrace datums: ``cross_entropy`` weights become the mask; for the
policy losses the mask is where the advantages or the sampler logprobs are non-zero (Tinker
has no mask input; the backend zeroes both off the mask). ``loss:sum`` is computed from the
returned logprobs exactly as Tinker defines it. One difference remains and is documented: the
torch learner divides a step's gradient by its number of loss tokens (a per-token mean), where
Tinker sums; Adam makes the two nearly equivalent, except where gradient clipping bites.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from headrace.core.types import AdamParams, Datum, LossSpec, SamplingParams, StopReason
from headrace.tinker_emulator.codec import WireDatum
from headrace.tinker_emulator.compute import SampleSpec, Sequence3, loss_and_grad

_ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


def _datum(d: WireDatum, loss_fn: str, forward_only: bool) -> Datum:
    n = len(d.tokens)
    target = d.inputs["target_tokens"].astype(np.int64).tolist()
    if len(target) != n:
        raise ValueError(f"target_tokens has {len(target)} entries for {n} input tokens")
    if loss_fn == "cross_entropy":
        mask = d.inputs.get("weights", np.ones(n, dtype=np.float32)).astype(float)
        logprobs, adv = np.zeros(n), np.zeros(n)
    else:
        logprobs, adv = d.inputs["logprobs"].astype(float), d.inputs["advantages"].astype(float)
        mask = ((adv != 0) | (logprobs != 0)).astype(float)
    if forward_only:  # no loss tokens: the backward adds nothing (torch has no forward-only call)
        mask = np.zeros(n)
    return Datum(list(d.tokens), target, logprobs.tolist(), adv.tolist(), mask.tolist())


def lora_targets(lora: dict[str, Any]) -> list[str]:
    """Tinker's LoRA switches as the Llama module names they cover (all on by default)."""
    targets = []
    if lora.get("train_attn", True):
        targets += ["q_proj", "k_proj", "v_proj", "o_proj"]
    if lora.get("train_mlp", True):
        targets += ["gate_proj", "up_proj", "down_proj"]
    if lora.get("train_unembed", True):
        targets.append("lm_head")
    return targets


class _TorchSampler:
    def __init__(self, backend: Any, handle: Any):
        self.backend, self.handle = backend, handle

    async def sample(self, prompt: list[int], n: int, spec: SampleSpec) -> list[Sequence3]:
        params = SamplingParams(
            max_tokens=spec.max_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            stop_token_ids=spec.stop_tokens,
            seed=spec.seed,
        )
        samples = await self.backend.sampling.sample(self.handle, prompt, n, params)
        return [(s.tokens, s.logprobs, "stop" if s.stop_reason == StopReason.STOP else "length") for s in samples]


class _TorchTrainer:
    def __init__(self, backend: Any, on_close: Any = None):
        self.backend, self._on_close, self._closed = backend, on_close, False
        self._versions = itertools.count(1)
        self._names = itertools.count()

    async def forward_backward(self, data, loss_fn, config, forward_only):
        datums = [_datum(d, loss_fn, forward_only) for d in data]
        spec = LossSpec(loss_fn, {k: float(v) for k, v in config.items() if not isinstance(v, str)})
        result = await self.backend.training.forward_backward(datums, spec)
        total = 0.0
        for d, logp in zip(data, result.logprobs_D, strict=True):
            loss, _ = loss_and_grad(loss_fn, config, np.asarray(logp, dtype=np.float64), d.inputs)
            total += loss
        return result.logprobs_D, {"loss:sum": total}

    async def optim_step(self, adam):
        params = AdamParams(**{k: float(adam[k]) for k in _ADAM_KEYS if k in adam})
        result = await self.backend.training.optim_step(params)
        return {f"{k.removeprefix('optim/')}:mean": float(v) for k, v in result.metrics.items()}

    async def save(self):
        return await self.backend.training.save_state(f"ckpt-{next(self._names)}")

    async def load(self, blob, optimizer):
        await self.backend.training.load_state(blob)
        if not optimizer:
            self.backend.training.optimizer.state.clear()  # weights only: a fresh optimizer

    async def sampler(self):
        return _TorchSampler(self.backend, await self.backend.training.publish(next(self._versions)))

    async def close(self):
        if not self._closed:
            self._closed = True
            if self._on_close is not None:
                self._on_close(self)
            await self.backend.__aexit__(None, None, None)


class TorchCompute:
    """Tinker models on headrace's torch backend, one per name in ``models`` (default: ``tiny``)."""

    def __init__(self, device: str = "cpu", models: tuple[str, ...] | list[str] = ("tiny",)):
        from headrace.backends.torch.model import resolve_device
        from headrace.models import TINY, model_dir

        resolve_device(device)  # cuda asked for on a machine without: refused now, not at the first model
        for name in models:
            if name != TINY:
                model_dir(name)  # weights that can't be found fail the start (converts a GGUF once)
        self.models = list(models)
        self.device = device
        self._dir = Path(tempfile.mkdtemp(prefix="headrace-tinker-emulator-"))
        self._ids = itertools.count()
        self._trainers: set[_TorchTrainer] = set()  # open ones: an evicted model's trainer closes itself
        self._base: dict[str, Any] = {}

    async def _backend(self, base_model: str, lora: dict[str, Any]) -> Any:
        from headrace.backends.torch import make_backend
        from headrace.backends.torch.config import TorchConfig
        from headrace.core.protocols import BackendContext

        torch_cfg: dict[str, Any] = {"lora_rank": int(lora.get("rank", 0)), "device": self.device}
        if torch_cfg["lora_rank"]:
            torch_cfg["lora_target_modules"] = lora_targets(lora)
        ctx = BackendContext(
            model=base_model, seed=lora.get("seed") or 0, run_dir=str(self._dir / f"model-{next(self._ids)}")
        )
        backend = await asyncio.to_thread(make_backend, TorchConfig(**torch_cfg), ctx)
        await backend.__aenter__()
        return backend

    async def create(self, base_model: str, lora: dict[str, Any]) -> _TorchTrainer:
        trainer = _TorchTrainer(await self._backend(base_model, lora), self._trainers.discard)
        self._trainers.add(trainer)
        return trainer

    async def base_sampler(self, base_model: str) -> _TorchSampler:
        if base_model not in self._base:
            self._base[base_model] = await self._backend(base_model, {"rank": 0, "seed": 0})
        backend = self._base[base_model]
        return _TorchSampler(backend, backend.initial_handle())

    async def close(self) -> None:
        for trainer in list(self._trainers):
            await trainer.close()
        for backend in self._base.values():
            await backend.__aexit__(None, None, None)
        shutil.rmtree(self._dir, ignore_errors=True)

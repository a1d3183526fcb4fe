"""Wiring: one model, one device thread, a trainer and a sampler over the same weights."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from headrace.core.protocols import BackendContext
from headrace.core.types import AdamParams, SamplerHandle

from .config import TorchConfig
from .device_thread import DeviceThread
from .flops import PerfMeter, peak_flops
from .model import DTYPES, TINY, LoadedModel, choose_dtype, load_model, resolve_device, trainable_parameters
from .sampler import TorchSampler
from .trainer import TorchTrainer
from .weights import PublishedWeights, SamplerModel, snapshot

SWITCH_INTERVAL_S = 0.0005


class TorchBackend:
    def __init__(self, config: TorchConfig, ctx: BackendContext):
        self.config, self.ctx = config, ctx
        self.device = resolve_device(config.device)
        # "auto" resolved here, so config.json, describe() and a vLLM sampler say what ran
        config = config.model_copy(update={"dtype": choose_dtype(config.dtype, ctx.model, self.device)})
        self.config = config
        self.dtype = config.dtype  # what a separate sampler (vLLM) serves the weights in
        threads = config.num_threads or default_threads(ctx.model, self.device.type)
        self.num_threads = threads or torch.get_num_threads()
        # torch's thread count is the process's: set only while building here, and on the device
        # thread (its own), so the caller's setting is what it was once the backend is built
        with torch_threads(threads):
            self.loaded: LoadedModel = load_model(ctx.model, config, self.device, ctx.seed)
        self.tokenizer = self.loaded.tokenizer
        model = self.loaded.model
        model.eval()  # no dropout anywhere: the learner must compute the sampler's distribution
        params = trainable_parameters(model)
        self._device_thread = DeviceThread(num_threads=threads)
        if ctx.run_dir:
            self._tmp_dir = None
            ckpt_dir = Path(ctx.run_dir) / "checkpoints"
        else:
            self._tmp_dir = Path(tempfile.mkdtemp(prefix="headrace-torch-"))
            ckpt_dir = self._tmp_dir / "checkpoints"
        self._initial = SamplerHandle(0, self._published(0, snapshot(params)))
        self._peak: list[float] = []  # probed on first use, on the device thread (its torch threads)
        self.meter = PerfMeter(self._peak_flops)
        self.sampling = TorchSampler(
            SamplerModel(model, set(params), self._initial.ref),
            self._device_thread,
            self.device,
            self.loaded.pad_token_id,
            self.loaded.stop_token_ids,
            config.sample_batch_wait_s,
            config.max_sample_batch,
            seed=ctx.seed,
            meter=self.meter,
            decode_step=config.decode_step,
        )
        self.training = TorchTrainer(
            model,
            params,
            self._device_thread,
            self.device,
            self.loaded.pad_token_id,
            AdamParams(),  # placeholders: every optim_step brings the run's Adam settings
            ckpt_dir,
            publisher=self._published,
            microbatch_size=config.microbatch_size,
            identity=self._identity(),
            max_nonfinite_skips=config.max_nonfinite_skips,
            extra_state=lambda: {"sampler_unseeded_requests": self.sampling.unseeded_requests},
            restore_extra=self._restore_extra,
            # LoRA's reference is the base itself, adapter disabled
            reference_model=None if self.loaded.lora else self._reference_model,
            gradient_sum=ctx.gradient_sum,
            meter=self.meter,
            pack=config.pack,
            share_prefix=config.share_prefix,
        )
        self._switching = False

    def _peak_flops(self) -> float:
        if not self._peak:
            self._peak.append(peak_flops(self.device, DTYPES[self.config.dtype]))
        return self._peak[0]

    def _identity(self) -> dict[str, Any]:
        """What a checkpoint must match to be loaded here."""
        identity = {"model": self.ctx.model, "kind": self.kind, "lora_rank": self.loaded.lora_rank}
        if self.loaded.lora and self.ctx.model == TINY:
            identity["base_seed"] = self.ctx.seed  # the frozen base is rebuilt from the seed, not stored
        return identity

    @property
    def kind(self) -> str:
        return "lora" if self.loaded.lora else "full"

    def _published(self, version: int, tensors: dict[str, torch.Tensor]) -> PublishedWeights:
        peft_config = getattr(self.loaded.model, "peft_config", {}).get("default") if self.loaded.lora else None
        return PublishedWeights(version, self.kind, tensors, self.ctx.model, peft_config, self._export_full)

    def _reference_model(self) -> torch.nn.Module:
        """The initial weights again, for ``loss.kl_coef > 0`` with full fine-tuning: the tiny
        model from the run seed, a pretrained one from its directory (never a resumed state).
        Built on the device thread, on first use."""
        return load_model(self.ctx.model, self.config, self.device, self.ctx.seed).model

    def _restore_extra(self, extra: dict[str, Any]) -> None:
        self.sampling.unseeded_requests = int(extra.get("sampler_unseeded_requests", 0))

    # ---- Backend protocol ----

    async def __aenter__(self) -> TorchBackend:
        # The device thread needs the GIL back between torch ops; with the default 5 ms switch
        # interval a busy event loop makes it wait that long each time, and pipelining then
        # loses time instead of saving it (benchmarks/pipelining_torch.py: ratio 0.96-1.0 at
        # 5 ms, 1.10 at 0.5 ms). Restored when the last running torch backend exits.
        if not self._switching:
            _FAST_SWITCHING.hold()
            self._switching = True
        self._device_thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self._device_thread.shutdown)
        if self._switching:
            self._switching = False
            _FAST_SWITCHING.release()
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)

    def initial_handle(self) -> SamplerHandle:
        return self._initial

    # ---- weights between processes (--cluster ray): what a publish hands a sampler elsewhere ----

    @staticmethod
    def weights_of(handle: SamplerHandle) -> dict[str, Any]:
        """A published version's trainable tensors as numpy arrays: they travel through Ray's
        shared-memory object store without a copy (bfloat16, which numpy lacks, as its bits)."""
        out = {}
        for name, t in handle.ref.tensors.items():
            t = t.detach().to("cpu")
            out[name] = (t.view(torch.int16).numpy(), "bfloat16") if t.dtype == torch.bfloat16 else (t.numpy(), "")
        return out

    def handle_for(self, version: int, weights: dict[str, Any]) -> SamplerHandle:
        """This process's handle on weights published by another (``weights_of``'s arrays)."""
        tensors = {}
        for name, (array, bits_of) in weights.items():
            t = torch.tensor(array)
            tensors[name] = (t.view(torch.bfloat16) if bits_of == "bfloat16" else t).to(self.device)
        return SamplerHandle(version, self._published(version, tensors))

    def describe(self) -> dict[str, Any]:
        params = self.training.params
        return {
            "backend": "torch",
            "model": self.ctx.model,
            "device": str(self.device),
            "dtype": self.config.dtype,
            "finetune": "lora" if self.loaded.lora else "full",
            "lora_rank": self.loaded.lora_rank,
            "trainable_params": sum(p.numel() for p in params.values()),
            "total_params": sum(p.numel() for p in self.loaded.model.parameters()),
            "torch_threads": self.num_threads,
            "torch_version": torch.__version__,
        }

    # ---- exports, for other samplers (vLLM) ----

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids that always end a sample of this model (EOS and the generation config's)."""
        return self.loaded.stop_token_ids

    def export_weights(self, handle: SamplerHandle, directory: str | Path) -> str:
        """``handle``'s version as a PEFT adapter directory (LoRA; its base: ``export_base_model``)
        or a Hugging Face model directory with the tokenizer (full fine-tuning)."""
        return str(handle.ref.save(directory))

    def export_base_model(self, directory: str | Path) -> str:
        """A Hugging Face model directory of the frozen base (what a LoRA version applies to)."""
        if self.loaded.source is not None:
            return self.loaded.source
        if self.loaded.lora:
            no_lora = self.config.model_copy(update={"lora_rank": 0})
            base = load_model(TINY, no_lora, torch.device("cpu"), self.ctx.seed)
            return str(_save_model_dir(base.model, _hf_tokenizer(base), Path(directory), None))
        return str(_save_model_dir(self.loaded.model, _hf_tokenizer(self.loaded), Path(directory), None))

    def _export_full(self, directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
        return _save_model_dir(self.loaded.model, _hf_tokenizer(self.loaded), directory, tensors)


class _SwitchInterval:
    """``sys.setswitchinterval`` lowered while any torch backend runs. Backends may overlap (the
    Tinker emulator holds several) and exit in any order, so the first to start saves the
    process's value and the last to stop restores it."""

    def __init__(self, seconds: float):
        self.seconds, self._holders, self._saved, self._lock = seconds, 0, 0.0, threading.Lock()

    def hold(self) -> None:
        with self._lock:
            if not self._holders:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, self.seconds))
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if not self._holders:
                sys.setswitchinterval(self._saved)


_FAST_SWITCHING = _SwitchInterval(SWITCH_INTERVAL_S)


def default_threads(model: str, device: str) -> int:
    """CPU threads for the device thread when ``torch.num_threads`` is 0 (0 = leave torch's).

    On a CPU, every core but one: the event loop (rollouts, envs, the sampler's batching) needs
    one, and torch's default of every core oversubscribes the machine; on a shared 2-core machine
    two threads sampled SmolLM2 10-15x slower than one (benchmarks/RESULTS.md). The embedded tiny
    model gains nothing from more than one. On a GPU, torch's default."""
    if device != "cpu":
        return 0
    if model == TINY:
        return 1
    return max(1, len(os.sched_getaffinity(0)) - 1) if hasattr(os, "sched_getaffinity") else 1


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """``torch.set_num_threads(n)`` for the block (0: unchanged), restored after it."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n:
            torch.set_num_threads(before)


def _hf_tokenizer(loaded: LoadedModel) -> Any:
    if loaded.hf_tokenizer is None:
        raise ValueError(f"model '{loaded.name}' has no transformers tokenizer to export a model directory with")
    return loaded.hf_tokenizer()


def _save_model_dir(model: Any, hf_tokenizer: Any, directory: Path, tensors: dict | None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    state = None if tensors is None else {k: v.detach().to("cpu") for k, v in tensors.items()}
    model.save_pretrained(str(directory), state_dict=state)
    hf_tokenizer.save_pretrained(str(directory))
    return directory

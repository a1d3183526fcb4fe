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

Sampling: stop token ids join the model's own (its EOS and generation config's), which always
end a sample, so ``stop=[]`` does not turn EOS off here as it does on the service. Stop strings
are matched on the text the model's tokenizer decodes (special tokens skipped): the sample is
drawn to ``max_tokens`` or EOS, then cut after the token that completed the string, which
draws exactly the tokens the service would have (a sample's tokens never depend on what comes
after them). Prompt logprobs are a forward pass of the sampler's own weights, on the device
thread, between sampling batches. The vocabulary (for the 400 that names its size) is read from
the model's ``config.json`` before it loads, then from its embedding once loaded. Each sample
request is its own batch (the torch sampler's ``"alone"`` batching): requests reach the emulator
at times no client controls, so batching them together would make a seeded request's tokens
depend on what else was being sampled; alone, the same request gives the same tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from headrace.core.types import AdamParams, Datum, LossSpec, SamplingParams, StopReason
from headrace.tinker_emulator.codec import WireDatum
from headrace.tinker_emulator.compute import (
    PromptLogprobs,
    SampleSpec,
    Sequence3,
    check_token_ids,
    empty_topk,
    loss_and_grad,
)

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


def vocab_of(backend: Any) -> int:
    """The number of token ids a loaded model has rows for."""
    return int(backend.loaded.model.get_input_embeddings().num_embeddings)


class _TorchSampler:
    def __init__(self, backend: Any, handle: Any):
        self.backend, self.handle = backend, handle
        self.vocab_size = vocab_of(backend)

    def decode(self, tokens: Any) -> str:
        return self.backend.tokenizer.decode(list(tokens))

    async def sample(self, prompt: list[int], n: int, spec: SampleSpec) -> list[Sequence3]:
        check_token_ids("the prompt", prompt, self.vocab_size)
        params = SamplingParams(
            max_tokens=spec.max_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            stop_token_ids=spec.stop_tokens or (),
            seed=spec.seed,
        )
        samples = await self.backend.sampling.sample(self.handle, prompt, n, params)
        return [(s.tokens, s.logprobs, "stop" if s.stop_reason == StopReason.STOP else "length") for s in samples]

    async def adapter_files(self) -> dict[str, bytes]:
        """These weights as the service archives a sampler checkpoint (``tinker_adapter``)."""
        return await asyncio.to_thread(tinker_adapter, self.handle.ref)

    async def prompt_logprobs(self, prompt: list[int], topk: int) -> PromptLogprobs:
        check_token_ids("the prompt", prompt, self.vocab_size)
        return await self.backend.sampling.forward(
            self.handle, lambda module: self._prompt_logprobs(module, prompt, topk)
        )

    def _prompt_logprobs(self, module: Any, prompt: list[int], topk: int) -> PromptLogprobs:  # the device thread
        import torch

        T, k = len(prompt), min(topk, self.vocab_size)
        out = np.full(T, np.nan, dtype=np.float32)
        top_ids, top_lps = empty_topk(T, k) if k else (None, None)
        if T < 2:
            return PromptLogprobs(out, top_ids, top_lps)
        ids = torch.tensor([prompt], dtype=torch.long, device=self.backend.device)
        logp = module(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
        out[1:] = logp.gather(-1, ids[0, 1:, None]).squeeze(-1).cpu().numpy()
        if top_ids is not None and top_lps is not None:
            values, indices = logp.topk(k, dim=-1)
            top_ids[1:] = indices.cpu().numpy().astype(np.int32)
            top_lps[1:] = values.cpu().numpy()
        return PromptLogprobs(out, top_ids, top_lps)


def tinker_adapter(weights: Any) -> dict[str, bytes]:
    """A LoRA version in the Tinker service's adapter format (what its checkpoint archives hold, as
    the Tinker cookbook's ``weights`` module reads them): ``adapter_model.safetensors`` under PEFT's
    names except the output layer's, which Tinker calls ``model.unembed_tokens``, and an
    ``adapter_config.json`` with the rank and alpha only."""
    from safetensors.torch import save

    if weights.kind != "lora":
        raise ValueError("this checkpoint is a full fine-tune; the emulator archives LoRA adapters only")
    unembed = ("base_model.model.lm_head.", "base_model.model.model.unembed_tokens.")
    tensors = {key.replace(*unembed): t.detach().cpu().contiguous() for key, t in weights.peft_state_dict().items()}
    config = {"lora_alpha": weights.peft_config.lora_alpha, "r": weights.peft_config.r}
    return {"adapter_model.safetensors": save(tensors), "adapter_config.json": json.dumps(config).encode()}


class _TorchTrainer:
    def __init__(self, backend: Any, on_close: Any = None):
        self.backend, self._on_close, self._closed = backend, on_close, False
        self._versions = itertools.count(1)
        self._names = itertools.count()
        self.vocab_size = vocab_of(backend)

    async def forward_backward(self, data, loss_fn, config, forward_only):
        for d in data:
            check_token_ids("a datum's model_input", d.tokens, self.vocab_size)
            check_token_ids("a datum's target_tokens", d.inputs["target_tokens"], self.vocab_size)
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

    def __init__(self, device: str = "cpu", models: tuple[str, ...] | list[str] = ("tiny",), dtype: str = "auto"):
        from headrace.backends.torch.model import resolve_device
        from headrace.models import TINY, model_dir

        resolve_device(device)  # cuda asked for on a machine without: refused now, not at the first model
        self._facts: dict[str, tuple[int | None, int | None]] = {}  # model -> (vocabulary, context)
        for name in models:
            # weights that can't be found fail the start (converts a GGUF once)
            self._facts[name] = _tiny_facts() if name == TINY else _config_facts(model_dir(name))
        self.models = list(models)
        self.device, self.dtype = device, dtype
        self._dir = Path(tempfile.mkdtemp(prefix="headrace-tinker-emulator-"))
        self._ids = itertools.count()
        self._trainers: set[_TorchTrainer] = set()  # open ones: an evicted model's trainer closes itself
        self._base: dict[str, Any] = {}

    def vocab_size(self, model: str) -> int | None:
        return self._facts.get(model, (None, None))[0]

    def max_context(self, model: str) -> int | None:
        return self._facts.get(model, (None, None))[1]

    async def _backend(self, base_model: str, lora: dict[str, Any]) -> Any:
        from headrace.backends.torch import make_backend
        from headrace.backends.torch.config import TorchConfig
        from headrace.core.protocols import BackendContext

        torch_cfg: dict[str, Any] = {"lora_rank": int(lora.get("rank", 0)), "device": self.device, "dtype": self.dtype}
        if torch_cfg["lora_rank"]:
            torch_cfg["lora_target_modules"] = lora_targets(lora)
        ctx = BackendContext(
            model=base_model, seed=lora.get("seed") or 0, run_dir=str(self._dir / f"model-{next(self._ids)}")
        )
        backend = await asyncio.to_thread(make_backend, TorchConfig(**torch_cfg), ctx)
        backend.sampling.batching = "alone"  # see the module docstring
        await backend.__aenter__()
        self._facts[base_model] = (vocab_of(backend), self.max_context(base_model))  # the loaded model's word
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


def _tiny_facts() -> tuple[int, int]:
    from headrace.backends.torch.model import tiny_llama_config
    from headrace.tokenizers.char import CharTokenizer

    config = tiny_llama_config(CharTokenizer().vocab_size)
    return int(config.vocab_size), int(config.max_position_embeddings)


def _config_facts(directory: Path | None) -> tuple[int | None, int | None]:
    """Vocabulary and context length from a Hugging Face ``config.json`` (None where it says nothing)."""
    try:
        config = json.loads(((directory or Path()) / "config.json").read_text())
    except (OSError, ValueError):
        return None, None
    config = config.get("text_config", config) if isinstance(config, dict) else {}

    def num(key: str) -> int | None:
        value = config.get(key)
        return value if isinstance(value, int) else None

    return num("vocab_size"), num("max_position_embeddings")

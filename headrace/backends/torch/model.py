"""Loading the policy: ``--model`` resolved through :mod:`headrace.models` (the embedded tiny
model, a registered name such as ``smollm2-135m``, a local directory, a ``.gguf`` file or a
Hugging Face name), with LoRA when the config or the model's default asks for it.

Every failure to find a model is a :class:`ModelLoadError` (a ``ConfigError``): one paragraph
that says what was tried and how to point at a local directory, never a deep traceback.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headrace.core.errors import ConfigError
from headrace.core.types import Tokenizer
from headrace.models import TINY, ModelLoadError, model_dir, model_spec
from headrace.models.errors import first_line as _first_line
from headrace.tokenizers.char import CharTokenizer
from headrace.tokenizers.hf import HFTokenizer

from .config import TorchConfig

__all__ = [
    "TINY",
    "LoadedModel",
    "ModelLoadError",
    "choose_dtype",
    "has_bf16_matrix_units",
    "load_model",
    "resolve_device",
    "trainable_parameters",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: nn.Module  # the trainable module (a PeftModel when LoRA is on)
    tokenizer: Tokenizer  # what the engine and envs see
    stop_token_ids: tuple[int, ...]  # always end a sample (EOS and the generation config's)
    pad_token_id: int
    name: str
    lora: bool
    hf_tokenizer: Callable[[], Any] | None = None  # a transformers tokenizer, to export a model directory
    source: str | None = None  # the directory the weights came from (None for the embedded model)
    lora_rank: int = 0  # what was applied: torch.lora_rank, or the model's default when that is None


def tiny_llama_config(vocab_size: int):  # -> transformers.LlamaConfig
    """The embedded default: 2 layers, hidden 256, a character vocabulary (~1.3 M parameters).

    Sized on the default arithmetic task on 2 CPU cores: hidden 64-128 needed 2-3x the steps
    and often plateaued below 0.9 reward; hidden 256 passes 0.9 in 50-60 steps."""
    from transformers import LlamaConfig

    chars = CharTokenizer()
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=chars.bos_token_id,
        eos_token_id=chars.eos_token_id,
        pad_token_id=chars.pad_token_id,
    )


BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``); empty where that cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_bf16_matrix_units(
    device: torch.device, flags: frozenset[str] | None = None, capability: tuple[int, int] | None = None
) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices in hardware: a CPU with AMX-BF16 or
    AVX512-BF16, a CUDA GPU of compute capability 8.0 (Ampere) or later. ``flags`` and
    ``capability`` stand in for the machine's (tests)."""
    if device.type == "cuda":
        cc = capability if capability is not None else torch.cuda.get_device_capability(device)
        return tuple(cc) >= (8, 0)
    if device.type == "cpu":
        return bool(BF16_CPU_FLAGS & (flags if flags is not None else cpu_flags()))
    return False


def choose_dtype(
    requested: str,
    model: str,
    device: torch.device,
    flags: frozenset[str] | None = None,
    capability: tuple[int, int] | None = None,
) -> str:
    """``torch.dtype``, with ``auto`` resolved: bfloat16 for a pretrained model where the device
    has bfloat16 matrix units, else float32. The embedded tiny model stays float32: its matmuls
    are too small for the units to pay for the casts (benchmarks/RESULTS.md, "Real-model speed")."""
    if requested != "auto":
        return requested
    if model == TINY:
        return "float32"
    return "bfloat16" if has_bf16_matrix_units(device, flags, capability) else "float32"


ATTENTION = ("eager", "sdpa")


def choose_attention(requested: str, device: torch.device) -> str:
    """``torch.attention``, with ``auto`` resolved: eager on a CPU, sdpa elsewhere; the sampler and
    the learner use the same one. On a CPU the SDPA flash kernel costs more than the matmuls it
    replaces at the lengths RL trains on (SmolLM2, 8 x 56 tokens, bfloat16, one thread: a
    forward+backward pass 6.5 s eager against 9.0 s SDPA), and in bfloat16 its results depend on
    the pass's shape: SDPA decoding against the cache and SDPA (or eager) over the whole sequence
    disagree by a mean KL of ~2e-3, eager in both agrees exactly (benchmarks/RESULTS.md,
    "Real-model speed")."""
    if requested == "auto":
        return "eager" if device.type == "cpu" else "sdpa"
    if requested not in ATTENTION:
        raise ConfigError(f"torch.attention='{requested}' is not one of auto, {', '.join(ATTENTION)}")
    return requested


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"torch.device='{name}' but CUDA is not available here; use torch.device=cpu or auto")
    return device


def load_model(model: str, cfg: TorchConfig, device: torch.device, seed: int) -> LoadedModel:
    dtype = DTYPES.get(choose_dtype(cfg.dtype, model, device))
    if dtype is None:
        raise ConfigError(f"torch.dtype='{cfg.dtype}' is not one of auto, {', '.join(DTYPES)}")
    if model == TINY:
        loaded = _load_tiny(seed, dtype)
    else:
        loaded = _load_pretrained(model, dtype)
    if dtype != torch.float32:
        from .norms import replace_rms_norms

        # a hand-written backward; the forward unchanged to the bit (float32 keeps transformers' own)
        replace_rms_norms(loaded.model)
        from .layers import replace_llama_layers

        # the same forward values; rotary, grouped attention and LoRA's A matrices with less work
        replace_llama_layers(loaded.model)
        from .head import replace_head

        # float32 logits, so the sampler's and the learner's logprobs do not round a step apart
        replace_head(loaded.model)
    loaded.model.to(device)
    loaded.model.set_attn_implementation(choose_attention(cfg.attention, device))  # type: ignore[operator]
    rank = model_spec(model).lora_rank if cfg.lora_rank is None else cfg.lora_rank
    if rank > 0:
        # the run seed picks the adapter's initial weights too (PEFT draws them from the global
        # RNG, whose state depends on whatever ran in this process before), without disturbing it
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            loaded.model = _add_lora(loaded.model, cfg, rank)
        loaded.lora, loaded.lora_rank = True, rank
    return loaded


def _load_tiny(seed: int, dtype: torch.dtype) -> LoadedModel:
    from transformers import LlamaForCausalLM

    from headrace.tokenizers.tiny_hf import hf_tokenizer

    tok = CharTokenizer()
    # the run seed picks the initial weights, without disturbing the global RNG
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_llama_config(tok.vocab_size)).to(dtype)
    return LoadedModel(
        model=model,
        tokenizer=tok,
        stop_token_ids=(tok.eos_token_id,),
        pad_token_id=tok.pad_token_id,
        name=TINY,
        lora=False,
        hf_tokenizer=hf_tokenizer,  # only needed to export the model: built on demand
    )


def _load_pretrained(name: str, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = str(model_dir(name))
    try:
        hf_tok = AutoTokenizer.from_pretrained(source, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"could not load model '{name}' from '{source}': {_first_line(e)}. "
            "Check that the directory holds a Hugging Face causal LM (config.json, weights and tokenizer files)."
        ) from None
    tokenizer = HFTokenizer(hf_tok)
    _check_tokenizer_fits(name, tokenizer, model)
    stops = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stops.update([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        stop_token_ids=tuple(sorted(s for s in stops if s is not None)),
        pad_token_id=tokenizer.pad_token_id,
        name=name,
        lora=False,
        hf_tokenizer=lambda: hf_tok,
        source=source,
    )


def _check_tokenizer_fits(name: str, tokenizer: HFTokenizer, model) -> None:
    """A tokenizer from another model produces ids the embedding has no row for: refuse it
    here, with both sizes, instead of an index error deep inside the first forward pass.
    (A tokenizer smaller than the embedding is normal: vocabularies are padded.)"""
    rows = model.get_input_embeddings().num_embeddings
    if tokenizer.vocab_size > rows:
        raise ModelLoadError(
            f"the tokenizer of model '{name}' has {tokenizer.vocab_size} tokens but the model's embedding has only "
            f"{rows} rows: they do not belong together. Put the model's own tokenizer files next to its weights."
        )


def _add_lora(model: nn.Module, cfg: TorchConfig, rank: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=rank,
        lora_alpha=cfg.lora_alpha,
        target_modules=list(cfg.lora_target_modules),
        lora_dropout=0.0,  # dropout would make the learner's logprobs disagree with the sampler's
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        with warnings.catch_warnings():
            # peft calls a transformers API that transformers 5 deprecates; not ours to fix
            warnings.filterwarnings("ignore", category=FutureWarning)
            # adapters in the model's dtype: no cast of every LoRA input to float32 and back (about
            # 1.15x a bfloat16 training pass); the trainer keeps float32 masters of them to step
            peft_model = get_peft_model(model, lora, autocast_adapter_dtype=False)
    except ValueError as e:
        raise ConfigError(
            f"LoRA could not be applied: {_first_line(e)}. Set torch.lora_target_modules to module names "
            "of this model (e.g. q_proj, v_proj) or torch.lora_rank=0 for full fine-tuning."
        ) from None
    from .lora import fuse_lora  # peft is imported only once LoRA is asked for

    fuse_lora(peft_model)
    return peft_model


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """What the optimizer updates and what a published version snapshots (LoRA or everything)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


# logits computed in place of the head's output by these configs; with them set, the head runs
# through the model's own forward on every position
_POST_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def body_and_head(model: nn.Module) -> tuple[Any, Any]:
    """The model's decoder stack and LM head, to be called apart; (None, None) where the head's
    output is not the logits (post-head scaling) or the model does not expose them."""
    get_base_model = getattr(model, "get_base_model", None)  # PEFT wraps; LoRA lives in the base's layers
    base: Any = get_base_model() if get_base_model is not None else model
    config = getattr(base, "config", None)
    if any(getattr(config, name, None) not in (None, 1.0) for name in _POST_HEAD):
        return None, None
    try:
        body, head = base.get_decoder(), base.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None, None
    return (body, head) if body is not None and head is not None else (None, None)

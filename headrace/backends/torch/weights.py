"""Published versions: an immutable snapshot of the trainable tensors, carried by the handle.

``SamplerHandle.ref`` is a :class:`PublishedWeights`. Its tensors are cloned once at publish
time and never written again, so the sampler can point its modules at them without copying,
and a request keeps sampling the version it was issued with. A snapshot lives exactly as long
as something references it (a handle held by the sampler actor or by an in-flight request, or
the sampler's current weights); Python's refcounting prunes the rest, no registry needed.

Why every version is a clone: the optimizer updates the trainer's tensors in place, while the
sampler keeps serving v (its module points at v, and the engine's sampler actor holds v's handle
and issues requests with it) until v+1 is published, after that step. Sharing the trainer's
storage would let a step change v under a running or queued request; a copy-on-write clone taken
before each step would be taken every time for that same reason. The cost is one copy of the
trainable tensors per version: for LoRA (the default for pretrained models) an adapter of a few
MB; for a full fine-tune of SmolLM2-135M 513 MiB, 0.23-0.4 s on one CPU thread, and for a moment
a third copy (trainer, v-1 still sampling, v) until the sampler moves on and v-1 is freed.
Recycling a freed version's buffers would cut the 0.23 s to a 0.05 s copy, but keep that third
copy resident between publishes: not worth 1-2% of a ~16 s SmolLM2 step.

Other samplers (vLLM) read the same object: ``tensors`` by parameter name, ``save(dir)`` for a
PEFT adapter directory (LoRA) or a full Hugging Face model directory (full fine-tuning). The torch
sampler's own module (``SamplerModel``) shares the trainer's frozen weights and points its
trainable ones at a snapshot (``point_at``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

ADAPTER = "default"  # PEFT's name for the one adapter we train


@dataclass(frozen=True, eq=False)
class PublishedWeights:
    version: int
    kind: str  # "lora" | "full"
    tensors: dict[str, Tensor]  # trainable parameter name (as in model.named_parameters()) -> snapshot
    model_name: str  # 'tiny', a hub name or a directory: the base the tensors apply to
    peft_config: Any = None  # peft.LoraConfig when kind == "lora"
    _exporter: Any = field(default=None, repr=False)  # writes the base model dir for kind == "full"

    def peft_state_dict(self) -> dict[str, Tensor]:
        """LoRA tensors under the names a PEFT adapter file uses (no adapter name, no wrapper)."""
        if self.kind != "lora":
            raise ValueError("this version is a full fine-tune; use full_state_dict()")
        out = {}
        for name, t in self.tensors.items():
            key = name.replace(f".{ADAPTER}.", ".")
            out[key] = t
        return out

    def full_state_dict(self) -> dict[str, Tensor]:
        """Every trainable tensor under the base model's own names (what ``save_pretrained`` writes)."""
        if self.kind != "full":
            raise ValueError("this version is a LoRA adapter; use peft_state_dict()")
        return dict(self.tensors)

    def save(self, directory: str | Path) -> Path:
        """A PEFT adapter directory (LoRA) or a complete model directory with tokenizer (full)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        if self.kind == "lora":
            tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.peft_state_dict().items()}
            save_file(tensors, str(out / "adapter_model.safetensors"))
            config = copy.copy(self.peft_config)
            config.base_model_name_or_path = self.model_name
            config.save_pretrained(str(out))
        else:
            self._exporter(out, self.tensors)
        return out


def snapshot(named: dict[str, torch.nn.Parameter]) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in named.items()}


def point_at(params: dict[str, torch.nn.Parameter], tensors: dict[str, Tensor]) -> None:
    """Make ``params`` use ``tensors`` as their storage: a version swap without a copy."""
    missing = params.keys() - tensors.keys()
    if missing:
        raise KeyError(f"published weights lack {len(missing)} parameters, e.g. {sorted(missing)[0]}")
    for name, p in params.items():
        p.data = tensors[name]


class SamplerModel:
    """A second module over the same base weights whose trainable tensors follow a version."""

    def __init__(self, trainer_model: nn.Module, trainable_names: set[str], initial: PublishedWeights):
        memo: dict[int, Any] = {}
        for name, p in trainer_model.named_parameters():
            if name in trainable_names:
                # start directly on the initial snapshot instead of copying the trainer's tensor
                memo[id(p)] = nn.Parameter(initial.tensors[name], requires_grad=False)
            else:
                memo[id(p)] = p  # frozen base weights are shared, not copied
        self.module = copy.deepcopy(trainer_model, memo)
        self.module.eval()
        self.params = {n: p for n, p in self.module.named_parameters() if n in trainable_names}
        self.current: PublishedWeights = initial
        get_base_model = getattr(self.module, "get_base_model", None)  # PEFT injects LoRA into the base model's layers
        self.forward_module = get_base_model() if get_base_model is not None else self.module

    def use(self, weights: PublishedWeights) -> None:
        if weights is not self.current:
            point_at(self.params, weights.tensors)
            self.current = weights  # the previous snapshot is freed once no handle holds it

"""PEFT's LoRA linear layers with their plain case in one matmul call (imports peft: loaded only
once LoRA is applied, by ``model.py``)."""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora import Linear
from torch import nn

from .layers import with_adapter


class FusedLoraLinear(Linear):
    """A PEFT LoRA ``Linear`` whose plain case (one adapter, no dropout, no variant, not merged
    or disabled, the input in the adapter's dtype) is ``layers.with_adapter``: in float32
    ``base(x).addmm_(x A^T, B^T, alpha=scaling)``, the adapter's product, its scaling and the sum
    in one matmul call, where PEFT runs a matmul, then a multiply and an add over the whole output
    (bfloat16, SmolLM2's MLP shapes, one thread: those two passes cost about what the base matmul
    does); in bfloat16 the adapter's product added inside the base's matmul, rounded once.
    Anything else goes to PEFT's own forward."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        name = None if args or kwargs else plain_adapter(self)
        if name is None or self.lora_A[name].weight.dtype != x.dtype:
            return super().forward(x, *args, **kwargs)
        flat = x.reshape(-1, x.shape[-1])
        out = with_adapter(self.base_layer, flat, self.lora_A[name](flat), self.lora_B[name].weight, self.scaling[name])
        return out.view(*x.shape[:-1], out.shape[-1])


def plain_adapter(layer: Linear) -> str | None:
    """The name of ``layer``'s one active adapter when it is the plain case (no dropout, variant or
    bias; not merged or disabled), else None."""
    active = layer.active_adapters
    if layer.disable_adapters or layer.merged or len(active) != 1:
        return None
    name = active[0]
    if name not in layer.lora_A or name not in layer.lora_B or name in layer.lora_variant:
        return None
    if layer.lora_B[name].bias is not None or not isinstance(layer.lora_dropout[name], nn.Identity):
        return None
    return name


def plain_parts(layer: Any) -> tuple[nn.Module, nn.Module, nn.Module, float] | None:
    """(base layer, A, B, scaling) of a :class:`FusedLoraLinear` in its plain case, else None."""
    name = plain_adapter(layer) if isinstance(layer, FusedLoraLinear) else None
    if name is None:
        return None
    return layer.base_layer, layer.lora_A[name], layer.lora_B[name], layer.scaling[name]


class LeanLoraLinear(FusedLoraLinear):
    """The sampler's :class:`FusedLoraLinear`: the same arithmetic without its per-call checks and
    adapter lookups through ``nn.Module.__getattr__`` (~3,400 calls per sampling of issue 24's job;
    PEFT's own layer spent 1.15 s of a 7.4 s sampling there). Its adapter is fixed when
    :func:`lean_lora` switches it (the sampler's module never merges, disables or switches
    adapters); with gradients on, or another dtype, it is :class:`FusedLoraLinear`."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        base, a, b, scaling, dtype = self.__dict__["_lean"]
        if args or kwargs or torch.is_grad_enabled() or x.dtype != dtype:
            return super().forward(x, *args, **kwargs)
        flat = x.reshape(-1, x.shape[-1])
        out = with_adapter(base, flat, a.forward(flat), b.weight, scaling)
        return out.view(*x.shape[:-1], out.shape[-1])


def lean_lora(module: nn.Module) -> None:
    """The plain-case :class:`FusedLoraLinear` layers of ``module`` (the sampler's own copy)
    switched to :class:`LeanLoraLinear`, in place."""
    layer: Any
    for layer in module.modules():
        name = plain_adapter(layer) if type(layer) is FusedLoraLinear else None
        if name is not None and layer.lora_A[name].weight.dtype == layer.base_layer.weight.dtype:
            a = layer.lora_A[name]
            layer.__dict__["_lean"] = (layer.base_layer, a, layer.lora_B[name], layer.scaling[name], a.weight.dtype)
            layer.__class__ = LeanLoraLinear


def fuse_lora(model: nn.Module) -> None:
    """PEFT's LoRA linears in ``model`` switched to :class:`FusedLoraLinear`, in place. The
    sampler's module is a copy of this one, so both still run the same kernels."""
    for module in model.modules():
        if type(module) is Linear:
            module.__class__ = FusedLoraLinear

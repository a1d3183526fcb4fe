"""PEFT's LoRA linear layers with their plain case in one matmul call (imports peft: loaded only
once LoRA is applied, by ``model.py``)."""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora import Linear
from torch import nn


class FusedLoraLinear(Linear):
    """A PEFT LoRA ``Linear`` whose plain case (one adapter, no dropout, no variant, not merged
    or disabled, the input in the adapter's dtype) is ``base(x).addmm_(x A^T, B^T,
    alpha=scaling)``: the adapter's product, its scaling and the sum in one matmul call, where
    PEFT runs a matmul, then a multiply and an add over the whole output (bfloat16, SmolLM2's
    MLP shapes, one thread: those two passes cost about what the base matmul does). Anything
    else goes to PEFT's own forward."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        active = self.active_adapters
        if args or kwargs or self.disable_adapters or self.merged or len(active) != 1:
            return super().forward(x, *args, **kwargs)
        name = active[0]
        if name not in self.lora_A or name not in self.lora_B:
            return super().forward(x, *args, **kwargs)
        lora_a, lora_b = self.lora_A[name], self.lora_B[name]
        if (
            name in self.lora_variant
            or lora_b.bias is not None
            or not isinstance(self.lora_dropout[name], nn.Identity)
            or lora_a.weight.dtype != x.dtype
        ):
            return super().forward(x, *args, **kwargs)
        flat = x.reshape(-1, x.shape[-1])
        # in place on the base's fresh output (its backward does not read it): no copy of it,
        # the same bits as addmm
        out = self.base_layer(flat).addmm_(lora_a(flat), lora_b.weight.t(), alpha=self.scaling[name])
        return out.view(*x.shape[:-1], out.shape[-1])


def fuse_lora(model: nn.Module) -> None:
    """PEFT's LoRA linears in ``model`` switched to :class:`FusedLoraLinear`, in place. The
    sampler's module is a copy of this one, so both still run the same kernels."""
    for module in model.modules():
        if type(module) is Linear:
            module.__class__ = FusedLoraLinear

"""RMSNorm with a hand-written backward, for models loaded in a low precision: the forward is
transformers' Llama ``RMSNorm`` op for op (bit for bit, so the sampler, which shares the module,
and the learner still compute the same thing), the backward one expression instead of autograd's
chain through each cast, power, mean and product."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        hidden = x.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        rstd = torch.rsqrt(variance + eps)
        normed = hidden * rstd
        low = normed.to(x.dtype)
        ctx.save_for_backward(normed, rstd, weight, low if weight.requires_grad else None)
        return weight * low

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        normed, rstd, weight, low = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            # d/dx of x * rsqrt(mean(x^2) + eps), with g the gradient reaching the normed x
            g = (grad * weight).to(torch.float32)
            grad_x = (g - normed * (g * normed).mean(-1, keepdim=True)).mul_(rstd).to(grad.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (grad * low).reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        return grad_x, grad_w, None


class RMSNorm(nn.Module):
    """Holds the replaced module's ``weight`` (the same parameter: names and checkpoints unchanged)."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)


def _same_code(a: Any, b: Any) -> bool:
    ca, cb = a.__code__, b.__code__
    return (ca.co_code, ca.co_consts, ca.co_names) == (cb.co_code, cb.co_consts, cb.co_names)


def replace_rms_norms(model: nn.Module) -> int:
    """Every module whose forward is transformers' Llama RMSNorm's (the same bytecode: Llama,
    Qwen2/3, Mistral, ...) replaced by :class:`RMSNorm`, in place; how many were."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    reference = LlamaRMSNorm.forward
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            forward = getattr(type(child), "forward", None)
            weight = getattr(child, "weight", None)
            if forward is None or not isinstance(weight, nn.Parameter) or not hasattr(child, "variance_epsilon"):
                continue
            if forward is reference or _same_code(forward, reference):
                eps: Any = child.variance_epsilon
                setattr(parent, name, RMSNorm(weight, float(eps)))
                replaced += 1
    return replaced

"""The LM head of a model loaded in a low precision, with float32 logits from two low-precision
matmuls: ``r = x W^T`` rounded to bfloat16, then the rounding error ``x W^T - r``, accumulated in
float32 and rounded on its own (``addmm(-r, x, W^T)``), added back in float32.

Why: a bfloat16 logit of 8-16 has a step of 0.0625, so two matmuls that accumulate the same
products in another order (the sampler decoding 64 rows, the learner 3,000) can round one
token's logit a whole step apart, and its logprob with it. With the error added back the logits
match float32 arithmetic to ~3e-5 at twice the bfloat16 head's cost, where an upcast float32 head
costs ~6x (one thread, AMX): on SmolLM2 the sampler-learner mean k3 KL fell from 1.0e-3 to
below 1e-3 (benchmarks/RESULTS.md, "Numerics on AMX"). The sampler and the learner both call it:
the same module, the sampler's copy on prepacked weights (``generate.speed_up``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def compensated_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in float32 from low-precision ``x`` and ``weight`` (2-D ``x``)."""
    rounded = x @ weight.t()
    # bf16(x W^T - r), the sum taken in float32; beta=-1 rather than a negated copy of r, and r
    # added to the upcast error in place (one float32 copy, not two): the same bits
    # (tests/test_torch_layers.py)
    error = torch.addmm(rounded, x, weight.t(), beta=-1)
    return error.float().add_(rounded)


class _Float32Logits(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return compensated_logits(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # the plain low-precision head's gradient (what autograd gives a bfloat16 head)
        x, weight = ctx.saved_tensors
        g = grad.to(weight.dtype)
        grad_x = g @ weight if ctx.needs_input_grad[0] else None
        grad_w = g.t() @ x if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


class Float32LogitsHead(nn.Module):
    """Holds the replaced head's ``weight`` (the same parameter: tied embeddings, names and
    checkpoints unchanged)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight
        self.out_features, self.in_features = weight.shape  # read by transformers' weight tying

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        lead = hidden.shape[:-1]
        flat = hidden.reshape(-1, hidden.shape[-1])
        return _Float32Logits.apply(flat, self.weight).view(*lead, self.out_features)


def replace_head(model: nn.Module) -> bool:
    """The model's output embedding, where it is a plain bias-free ``nn.Linear`` in a low
    precision, replaced in place by :class:`Float32LogitsHead`; whether it was."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    if type(head) is not nn.Linear or head.bias is not None or head.weight.dtype == torch.float32:
        return False
    model.set_output_embeddings(Float32LogitsHead(head.weight))
    return True

"""The torch sampler's own module made to decode faster with the same numbers (its copy of the
learner's model, ``SamplerModel``: the learner's module is never touched): bfloat16 weights
prepacked for oneDNN's kernels on a CPU (the linears and the float32-logits head), float32
linears fed 2-D inputs (the prefill's head on its last positions), PEFT LoRA
layers without their per-call bookkeeping (``lora.lean_lora``), and eager attention without its
grouped-key copies when decoding. Each gives bit-identical results to what it replaces
(``tests/test_torch_sampler_speed.py``), so the sampler's logprobs still match the learner's
(benchmarks/RESULTS.md, "Sampling on AMX")."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor, nn

from .head import (
    Float32LogitsHead,
    float32_logits,
    float32_logits_prepacked,
    micro_kernel,
    one_matmul,
    pack_float32,
)

GROUPED_EAGER = "headrace_grouped_eager"


def speed_up(module: nn.Module) -> None:
    """``module``'s layers switched in place to their fast versions; ``module`` must be the
    sampler's own copy (its classes change)."""
    packs = _packs()
    for sub in module.modules():
        weight = getattr(sub, "weight", None)
        if not isinstance(weight, Tensor) or weight.device.type != "cpu":
            continue
        fast = _FAST.get((type(sub), weight.dtype))
        if fast is not None and (packs or fast is _FlatLinear):
            sub.__class__ = fast
    # LoRA layers exist only where model.py applied LoRA, which imported .lora (and peft): a model
    # without LoRA does not pay peft's import (~1.5 s) here
    lora = sys.modules.get(f"{__package__}.lora")
    if lora is not None:
        lora.lean_lora(module)
    config = getattr(module, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) == "eager" and _register_grouped():
        config._attn_implementation = GROUPED_EAGER


def _packs() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _packed_weight(module: Any, w: Tensor, wide: bool = False) -> Tensor:
    """``w`` in oneDNN's packed layout (``wide``: its float32 copy's), kept on ``module`` and made
    again whenever ``w``'s storage changes (a new version's adapter)."""
    if module._packed_of != (w.data_ptr(), w._version):
        if wide:
            module._packed = pack_float32(w)
        else:
            module._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64)
        # the packed tensor's storage kept alive, so a later version's tensor cannot be given its
        # address (and pass for it): a storage freed at a swap is the allocator's to hand out again
        module._packed_source = w.detach()
        module._packed_of = (w.data_ptr(), w._version)
    return module._packed


class _PackedLinear(nn.Linear):
    """``nn.Linear`` over a oneDNN-packed copy of its weight, made again whenever the weight's
    storage changes (a new version's adapter): at the decode batch's 64 rows the unpacked
    bfloat16 matmul spends most of its time packing the weight at every call."""

    _packed: Tensor | None = None
    _packed_of: tuple[int, int] | None = None

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if torch.is_grad_enabled() or x.dtype != w.dtype:
            return super().forward(x)
        packed = _packed_weight(self, w)
        lead = x.shape[:-1]
        # 2-D and contiguous: a 3-D strided input (the prefill's last position) would otherwise
        # go through a batched matmul that expands the whole weight
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, self.bias, "none", [], "")
        return out.view(*lead, out.shape[-1])

    def plus(self, x: Tensor, delta: Tensor) -> Tensor:
        """``round(x W^T + delta)`` for 2-D ``x``, rounded once (``layers.linear_plus``: a LoRA
        layer's sum): oneDNN's fused add on the packed weight."""
        w = self.weight
        if self.bias is not None:
            return super().forward(x).add_(delta)
        if torch.is_grad_enabled() or x.dtype != w.dtype:
            return torch.addmm(delta, x, w.t())  # the same bits (no backward for oneDNN's op)
        return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), delta, _packed_weight(self, w), None, "add")


class _PackedFloat32LogitsHead(Float32LogitsHead):
    """:class:`Float32LogitsHead` on a prepacked weight: where the head takes the micro-kernel
    (``head.py``), its own packed copy already; where it takes one matmul, a packed float32 copy;
    where it takes two, the bfloat16 weight, the rounding error's matmul through oneDNN's fused
    subtraction (``x W^T - r`` summed in float32, as ``addmm`` does). The learner's bits each way
    (``tests/test_torch_sampler_speed.py``)."""

    _packed: Tensor | None = None
    _packed_of: tuple[int, int] | None = None

    def forward(self, hidden: Tensor) -> Tensor:
        w = self.weight
        if torch.is_grad_enabled() or hidden.dtype != w.dtype:
            return super().forward(hidden)
        lead = hidden.shape[:-1]
        flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        if micro_kernel(flat, w):
            return float32_logits(flat, w).view(*lead, self.out_features)
        if one_matmul(flat, w):
            return float32_logits_prepacked(flat, _packed_weight(self, w, wide=True)).view(*lead, self.out_features)
        packed = _packed_weight(self, w)
        rounded = torch.ops.mkldnn._linear_pointwise(flat, packed, None, "none", [], "")
        # oneDNN's fused subtraction rather than a negated copy of r, and the error added to the
        # upcast r in place (one float32 copy, not two): the same bits, ~40% of the head's time
        # at 64 rows (the float32 [64, 49152] copies, not the matmuls, were most of it)
        error = torch.ops.mkldnn._linear_pointwise.binary(flat, rounded, packed, None, "sub")
        return rounded.float().add_(error).view(*lead, self.out_features)


class _FlatLinear(nn.Linear):
    """A float32 ``nn.Linear`` whose input is made 2-D and contiguous first: the prefill's head
    takes each prompt's last position, a strided 3-D view, which ``F.linear`` computes as a batched
    matmul over copies of the whole weight (on SmolLM2, 8 prompts: ~2.4x the 2-D matmul's time)."""

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        out = super().forward(x.reshape(-1, x.shape[-1]).contiguous())
        return out.view(*lead, out.shape[-1])


# (layer type, weight dtype) -> the sampler's version; bfloat16 ones only where oneDNN packs
_FAST: dict[tuple[type, Any], type] = {
    (nn.Linear, torch.bfloat16): _PackedLinear,
    (Float32LogitsHead, torch.bfloat16): _PackedFloat32LogitsHead,
    (nn.Linear, torch.float32): _FlatLinear,
}


def _register_grouped() -> bool:
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
        from transformers.models.llama.modeling_llama import eager_attention_forward
    except ImportError:
        return False

    def grouped(
        module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling, dropout=0.0, **kw
    ):
        # one new position per row (decoding): the query heads that share a key head are that
        # head's rows of one matmul, so the keys are not repeated per query head. Several
        # positions (the prefill): eager itself.
        rows, heads, new, dim = query.shape
        groups = getattr(module, "num_key_value_groups", 1)
        if new != 1 or module.training or groups == 1:
            return eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kw)
        kv = key.shape[1]
        q = query.reshape(rows, kv, groups, dim)
        weights = torch.matmul(q, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            weights = weights + attention_mask
        weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(weights, value)  # [rows, kv, groups, dim]
        return out.reshape(rows, 1, heads, dim), weights.reshape(rows, heads, 1, -1)

    AttentionInterface.register(GROUPED_EAGER, grouped)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_EAGER, eager_mask)
    return True

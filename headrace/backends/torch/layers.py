"""The learner's Llama attention and MLP for models loaded in a low precision: the same forward
values as transformers' modules, bit for bit (so the sampler, whose copy falls back to
transformers' forward whenever it decodes against a cache, still computes what the learner does),
with less work around the matmuls:

- rotary embeddings as one autograd function (``q cos + rotate_half(q) sin`` on the two halves
  in place: no negated copy, no concatenation, nothing saved but ``cos`` and ``sin``);
- grouped-query attention without ``repeat_kv``: the query heads that share a key head are that
  head's rows of one matmul (no copies of the keys and values per query head, nor the sum of
  their gradients back);
- the frozen bfloat16 base layers' matmuls on weights packed once for oneDNN (the same bits);
- each LoRA sum rounded once in a low precision (:func:`with_adapter`), not after the base's
  product was rounded: the adapter's small early steps are not lost;
- the LoRA ``A`` matrices of q/k/v (and of gate/up) in one matmul of rank 48 (32) instead of
  three (two) of rank 16: the same bits (oneDNN's rank-16 products do not depend on the other
  columns), a third of the calls in the forward and in both backward products.

The gradients are autograd's of the same expressions, summed in another order where the keys'
and values' are (not bit for bit autograd's of transformers' module; tested to round-off).
Only in a pass with a gradient, without a KV cache, with eager attention (the learner's); anything
else (the sampler's decode, forward-only calls) goes to transformers' forward.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP


class _Rotary(torch.autograd.Function):
    """``x * cos + rotate_half(x) * sin`` for ``x`` ``[batch, heads, seq, dim]`` and ``cos``,
    ``sin`` ``[batch, 1, seq, dim]``, rounded as transformers' expression is: each product
    rounded, then their sum (``-(a b)`` is ``(-a) b`` exactly, so the first half's sum is a
    difference)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        # contiguous whatever x's strides (a transposed view of the projection): the grouped
        # matmul then views it without a copy
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        o1, o2 = out[..., :half], out[..., half:]
        torch.mul(x1, cos[..., :half], out=o1)
        o1.sub_(x2 * sin[..., :half])
        torch.mul(x2, cos[..., half:], out=o2)
        o2.add_(x1 * sin[..., half:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        g1, g2 = grad[..., :half], grad[..., half:]
        out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        o1, o2 = out[..., :half], out[..., half:]
        # out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2
        torch.mul(g1, cos[..., :half], out=o1)
        o1.add_(g2 * sin[..., half:])
        torch.mul(g2, cos[..., half:], out=o2)
        o2.sub_(g1 * sin[..., :half])
        return out, None, None


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one of q, k (``cos``/``sin`` ``[batch, seq, dim]``)."""
    return _Rotary.apply(x, cos.unsqueeze(1), sin.unsqueeze(1))


def grouped_attention(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float
) -> tuple[Tensor, Tensor]:
    """transformers' ``eager_attention_forward`` without dropout, bit for bit, with the query
    heads of each key head as the rows of one matmul: ``query`` ``[b, heads, t, d]``, ``key`` and
    ``value`` ``[b, kv, s, d]``, ``mask`` additive ``[b, 1, t, s]`` or None. Returns the output
    ``[b, t, heads, d]`` and the weights ``[b, heads, t, s]``."""
    b, heads, t, d = query.shape
    kv, s = key.shape[1], key.shape[2]
    groups = heads // kv
    weights = torch.matmul(query.reshape(b, kv, groups * t, d), key.transpose(2, 3))
    weights = weights.view(b, kv, groups, t, s) * scaling
    if mask is not None:
        weights = weights + mask[:, :, None, :, :s]
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights.view(b, kv, groups * t, s), value)
    return out.view(b, heads, t, d).transpose(1, 2), weights.view(b, heads, t, s)


def _lora_parts(layers: list[Any], dtype: torch.dtype) -> list[tuple[Any, Any, Any, float]] | None:
    """(base, A, B, scaling) of each of ``layers`` when all are plain-case LoRA layers in
    ``dtype`` (``lora.plain_parts``), else None. Without LoRA loaded (.lora imports peft, done only
    once LoRA is applied) there are none."""
    lora = sys.modules.get(f"{__package__}.lora")
    if lora is None:
        return None
    parts = [lora.plain_parts(layer) for layer in layers]
    # frozen bases (LoRA's): their gradient is written by hand (_LoraGroup)
    if any(p is None or p[1].weight.dtype != dtype or p[0].weight.requires_grad for p in parts):
        return None
    return parts


def project(x: Tensor, layers: list[Any]) -> list[Tensor]:
    """Each of ``layers`` applied to 2-D ``x``: plain LoRA layers with their ``A`` matrices in one
    matmul, frozen bfloat16 base layers on prepacked weights (:func:`linear`)."""
    parts = _lora_parts(layers, x.dtype)
    if parts is None:
        return [linear(layer, x) for layer in layers]
    weights = [p[1].weight for p in parts]
    a_cat = weights[0] if len(weights) == 1 else torch.cat(weights)
    bases, scalings = [p[0] for p in parts], [float(p[3]) for p in parts]
    return list(_LoraGroup.apply(x, a_cat, bases, scalings, *(p[2].weight for p in parts)))


class _LoraGroup(torch.autograd.Function):
    """Frozen base layers with plain LoRA adapters over one input: ``base_i(x) + s_i (x A_i^T)
    B_i^T``, the ``A_i`` stacked in one matrix (one matmul for all), each sum as
    :func:`with_adapter` rounds it; the backward by hand, the adapters' input gradient summed
    into the bases' in the same matmul call (``addmm_``) rather than autograd's separate adds."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, a_cat: Tensor, bases: list[Any], scalings: list[float], *bs: Tensor) -> Any:
        a = F.linear(x, a_cat)
        outs, start = [], 0
        for base, scaling, b in zip(bases, scalings, bs, strict=True):
            rank = b.shape[1]
            outs.append(with_adapter(base, x, a[:, start : start + rank], b, scaling))
            start += rank
        ctx.bases, ctx.scalings = bases, scalings
        ctx.save_for_backward(x, a, a_cat, *bs)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        x, a, a_cat, *bs = ctx.saved_tensors
        parts, grad_bs, grad_x, start = [], [], None, 0
        for base, scaling, b, g in zip(ctx.bases, ctx.scalings, bs, grads, strict=True):
            rank = b.shape[1]
            g = g.contiguous()
            parts.append(torch.mm(g, b).mul_(scaling))
            grad_bs.append(torch.mm(g.t(), a[:, start : start + rank]).mul_(scaling))
            start += rank
            if ctx.needs_input_grad[0]:
                base_grad = _input_grad(base, g)
                grad_x = base_grad if grad_x is None else grad_x.add_(base_grad)
        grad_a = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
        if grad_x is not None:
            grad_x.addmm_(grad_a, a_cat)
        grad_a_cat = torch.mm(grad_a.t(), x) if ctx.needs_input_grad[1] else None
        return (grad_x, grad_a_cat, None, None, *grad_bs)


class _PackedLinear(torch.autograd.Function):
    """``x W^T`` on oneDNN-packed copies of a frozen ``W`` and of ``W^T`` (for the input's
    gradient): oneDNN's bfloat16 matmul on an unpacked weight packs it at every call."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, packed: Tensor, packed_t: Tensor) -> Tensor:
        ctx.packed_t = packed_t
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return torch.ops.mkldnn._linear_pointwise(grad.contiguous(), ctx.packed_t, None, "none", [], ""), None, None


# the packed copies, per base layer: outside the module, so the sampler's deep copy takes none
_PACKS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, int], Tensor, Tensor]] = weakref.WeakKeyDictionary()


def _packs() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(layer: Any, x: Tensor) -> Tensor:
    """``layer(x)``; for a bias-free bfloat16 ``nn.Linear`` on a CPU whose weight takes no
    gradient (LoRA's base), the same bits from a weight packed once (again whenever its storage
    changes), and its input's gradient from a packed transpose (SmolLM2's MLP shapes at 464 rows,
    one thread: 1.2-1.4x the unpacked matmul; the gradient not bit for bit the unpacked one's)."""
    w = getattr(layer, "weight", None)
    if type(layer) is not nn.Linear or layer.bias is not None or w is None or not _packable(w, x):
        return layer(x)
    cached = _packed(layer, w)
    return _PackedLinear.apply(x.contiguous(), cached[1], cached[2])


@runtime_checkable
class AddsToItsProduct(Protocol):
    """A linear layer that adds a tensor to its product before rounding it (the sampler's packed
    layers): ``round(x W^T + delta)``."""

    def plus(self, x: Tensor, delta: Tensor) -> Tensor: ...


def with_adapter(base: Any, x: Tensor, a: Tensor, b: Tensor, scaling: float) -> Tensor:
    """``base(x) + scaling (a B^T)`` for 2-D ``x`` and ``a = x A^T``: a LoRA layer's output.

    In a low precision the sum is rounded once, from the base matmul's float32 accumulator: the
    base's output rounded first (then the sum again) drops every adapter contribution under half
    a unit of its last place, which early in training is most of them (SmolLM2 in bfloat16 after
    its first GRPO step saw about half of the logprob change the same weights make in float32;
    ``benchmarks/bf16_update_check.py``). float32 keeps its arithmetic and bits: the adapter's
    product added onto the base's output by ``addmm_``."""
    if x.dtype == torch.float32:
        return linear(base, x).addmm_(a, b.t(), alpha=scaling)
    delta = torch.mm(a, b.t())
    if scaling != 1.0:
        delta.mul_(scaling)
    return linear_plus(base, x, delta)


def linear_plus(layer: Any, x: Tensor, delta: Tensor) -> Tensor:
    """``round(layer(x) + delta)`` for a linear ``layer`` and 2-D ``x``, rounded once: oneDNN's
    fused add on the packed weight where :func:`linear` packs and no gradient is taken (the bits
    the sampler's :class:`AddsToItsProduct` layers give), else ``addmm``, whose sum is the
    matmul's. A layer with a bias, or of another kind: its output plus ``delta``."""
    if isinstance(layer, AddsToItsProduct):
        return layer.plus(x, delta)
    if type(layer) is not nn.Linear or layer.bias is not None:
        return layer(x).add_(delta)
    w = layer.weight
    if _packable(w, x) and not torch.is_grad_enabled():  # oneDNN's op has no backward: addmm, the same bits
        cached = _packed(layer, w)
        return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), delta, cached[1], None, "add")
    return torch.addmm(delta, x, w.t())


def _packable(w: Tensor, x: Tensor) -> bool:
    return (
        not w.requires_grad and w.dtype == torch.bfloat16 and x.dtype == w.dtype and w.device.type == "cpu" and _packs()
    )


def _packed(layer: nn.Module, w: Tensor) -> tuple[tuple[int, int], Tensor, Tensor]:
    key = (w.data_ptr(), w._version)
    cached = _PACKS.get(layer)
    if cached is None or cached[0] != key:
        reorder = torch.ops.mkldnn._reorder_linear_weight
        cached = (key, reorder(w.detach(), 64), reorder(w.detach().t().contiguous(), 64))
        _PACKS[layer] = cached
    return cached


def _input_grad(layer: Any, grad: Tensor) -> Tensor:
    """The gradient of a frozen linear layer's input: on its packed transpose where
    :func:`linear` packed it."""
    cached = _PACKS.get(layer)
    w = layer.weight
    if cached is not None and cached[0] == (w.data_ptr(), w._version) and grad.dtype == w.dtype:
        return torch.ops.mkldnn._linear_pointwise(grad, cached[2], None, "none", [], "")
    return torch.mm(grad, w.to(grad.dtype))


def _fast(module: nn.Module, past_key_values: Any, kwargs: dict[str, Any]) -> bool:
    config: Any = getattr(module, "config", None)
    return (
        torch.is_grad_enabled()
        and past_key_values is None
        and config is not None
        and config._attn_implementation == "eager"
        and not kwargs.get("output_attentions")
        and (not module.training or getattr(module, "attention_dropout", 0.0) == 0.0)
    )


def replace_llama_layers(model: nn.Module) -> int:
    """transformers' ``LlamaAttention`` and ``LlamaMLP`` modules (exactly those classes; a SiLU
    MLP) switched in place to :class:`LearnerAttention` and :class:`LearnerMLP`; how many were."""
    switched = 0
    for module in model.modules():
        if type(module) is LlamaAttention:
            module.__class__ = LearnerAttention
            switched += 1
        elif type(module) is LlamaMLP and getattr(module.config, "hidden_act", None) == "silu":
            module.__class__ = LearnerMLP
            switched += 1
    return switched


class LearnerAttention(LlamaAttention):
    def forward(
        self,
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor]:
        mask_ok = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)
        if position_embeddings is None or not mask_ok or not _fast(self, past_key_values, kwargs):
            return super().forward(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        lead = hidden_states.shape[:-1]
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        q, k, v = project(flat, [self.q_proj, self.k_proj, self.v_proj])
        shape = (*lead, -1, self.head_dim)
        cos, sin = position_embeddings
        q = rotary(q.view(shape).transpose(1, 2), cos, sin)
        k = rotary(k.view(shape).transpose(1, 2), cos, sin)
        out, weights = grouped_attention(q, k, v.view(shape).transpose(1, 2), attention_mask, self.scaling)
        (out,) = project(out.reshape(-1, out.shape[-2] * out.shape[-1]).contiguous(), [self.o_proj])
        return out.view(*lead, -1), weights


class LearnerMLP(LlamaMLP):
    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled():  # the sampler's decode keeps its lean layers' path
            return super().forward(x)
        flat = x.reshape(-1, x.shape[-1])
        gate, up = project(flat, [self.gate_proj, self.up_proj])
        (out,) = project(self.act_fn(gate) * up, [self.down_proj])
        return out.view(*x.shape[:-1], out.shape[-1])

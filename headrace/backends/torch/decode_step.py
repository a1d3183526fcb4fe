"""One decode step of a Llama-family model written out for the sampler's copy on a CPU (bfloat16,
or float32 where the CPU has no bfloat16 units): the whole batch's next-token logits from its
last tokens, without transformers' per-step work.

At the decode batch's 64 rows the step is a chain of small operations, and what it costs beyond
the matmuls is per-operation work and copies, so the step does fewer of them:

- q, k and v are one matmul on their weights stacked (so are gate and up; in bfloat16 packed for
  oneDNN), and each group's LoRA adapters take the ``A`` matrices stacked in one matmul, then in
  bfloat16 the ``B`` matrices block-diagonal in one more, whose product is added inside the
  base's matmul (oneDNN's fused add: the sum rounded once, as the learner's), in float32 each
  ``B``'s product added into its own columns by ``addmm_``. The columns of a stacked product
  are the separate products' bits (``tests/test_torch_decode_step.py``);
- the keys and values are written into buffers with room for the rest of the generation, and
  attention reads the whole buffer (the columns not yet written are masked out), where the
  transformers cache concatenates every layer's keys and values at every step (in float32 on
  SmolLM2 those copies were about a quarter of the sampling); attention over a view of the
  written columns alone costs more than over the whole buffer (CPU batched matmuls copy strided
  batches);
- rotary embeddings for q and k in one call, RMSNorm in float32 as transformers' is.

The numbers are transformers' forward's up to float round-off: the matmuls give the same bits,
attention sums over more (masked, zero-weight) columns, so its float32 sums round differently
(benchmarks/RESULTS.md, "A decode step written out", measures the sampler against the learner).
A model this does not recognise (another architecture, biases, another dtype or device) keeps
transformers' forward: :func:`plan_for` returns None.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .fast_decode import GROUPED_EAGER, _FlatLinear, _PackedLinear, _packs
from .slots import KVSlots


def plan_for(module: nn.Module) -> DecodePlan | None:
    """A :class:`DecodePlan` for ``module`` (the sampler's causal LM) when it is a Llama-family
    model this step computes exactly (on a CPU, bfloat16 with oneDNN or float32, eager attention,
    no biases, SiLU MLPs, plain LoRA adapters or none), else None."""
    try:
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
    except ImportError:
        return None
    inner = getattr(module, "model", None)
    config = getattr(module, "config", None)
    head = getattr(module, "lm_head", None)
    if inner is None or config is None or head is None:
        return None
    if getattr(config, "_attn_implementation", None) not in ("eager", GROUPED_EAGER):
        return None
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "attention_bias", False):
        return None
    if getattr(config, "mlp_bias", False) or getattr(config, "sliding_window", None):
        return None
    layers = getattr(inner, "layers", None)
    if not layers or not all(type(layer) is LlamaDecoderLayer for layer in layers):
        return None
    embed = inner.embed_tokens
    matmuls = _MATMULS.get(embed.weight.dtype)
    if matmuls is None or embed.weight.device.type != "cpu" or (matmuls is _OneDNN and not _packs()):
        return None
    blocks = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, LlamaAttention) or not isinstance(mlp, LlamaMLP):
            return None
        norms = [_norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)]
        groups = [
            _Group.of([attn.q_proj, attn.k_proj, attn.v_proj], matmuls),
            _Group.of([attn.o_proj], matmuls),
            _Group.of([mlp.gate_proj, mlp.up_proj], matmuls),
            _Group.of([mlp.down_proj], matmuls),
        ]
        if any(n is None for n in norms) or any(g is None for g in groups):
            return None
        blocks.append(_Block(norms[0], norms[1], *groups))  # type: ignore[arg-type]
    final = _norm(inner.norm)
    if final is None:
        return None
    heads = config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return DecodePlan(module, blocks, final, heads, config.num_key_value_heads, dim)


def _norm(module: nn.Module) -> tuple[Tensor, float] | None:
    """(weight, eps) of an RMSNorm whose forward is transformers' Llama one (or headrace's copy)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from .norms import RMSNorm

    if type(module) not in (LlamaRMSNorm, RMSNorm):
        return None
    weight: Any = module.weight
    return weight, float(module.variance_epsilon)  # type: ignore[arg-type]


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # transformers' LlamaRMSNorm op for op (norms.py's forward): the same bits
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return weight * (hidden * torch.rsqrt(variance + eps)).to(x.dtype)


_Span = tuple[int, int, int, int, Tensor]  # an adapter's output rows, its columns of x A^T, its B


class _OneDNN:
    """bfloat16: weights packed for oneDNN (the sampler's ``_PackedLinear`` layers; at 64 rows the
    unpacked bfloat16 matmul spends most of its time packing the weight at every call), the
    adapters' ``B`` block-diagonal (pre-scaled: LoRA's scaling, a power of two here, multiplies
    exactly), their product added inside the base's matmul by oneDNN (rounded once)."""

    layer: type[nn.Module] = _PackedLinear
    dtype = torch.bfloat16
    prescales = True  # B times LoRA's scaling: exact only for a power of two

    @staticmethod
    def pack(w: Tensor) -> Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 64)

    @staticmethod
    def linear(x: Tensor, packed: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    @staticmethod
    def adapters(spans: list[_Span], outputs: int, scaling: float) -> Any:
        first = spans[0][4]
        block = torch.zeros((outputs, spans[-1][3]), dtype=first.dtype, device=first.device)
        for row, end, col, stop, b in spans:
            block[row:end, col:stop] = b * scaling
        return _OneDNN.pack(block)

    @staticmethod
    def with_adapters(x: Tensor, base: Tensor, xa: Tensor, packed: Any, scaling: float) -> Tensor:
        # the adapters' products first, then added inside the base's matmul: the sum rounded
        # once, as the learner's (layers.with_adapter)
        delta = torch.ops.mkldnn._linear_pointwise(xa, packed, None, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, delta, base, None, "add")


class _Plain:
    """float32: torch's own matmul (MKL's on a CPU, as the learner's and the plain layers' are) on
    the stacked weights, each adapter's product added into its columns by ``addmm_`` as
    ``lora.py`` adds it. A block-diagonal ``B`` here would round differently at one row (a
    matrix-vector product sums its zeros in other groupings)."""

    layer: type[nn.Module] = _FlatLinear
    dtype = torch.float32
    prescales = False

    @staticmethod
    def pack(w: Tensor) -> Tensor:
        return w.detach().contiguous()

    @staticmethod
    def linear(x: Tensor, w: Tensor) -> Tensor:
        return F.linear(x, w)

    @staticmethod
    def adapters(spans: list[_Span], outputs: int, scaling: float) -> Any:
        return [(row, end, col, stop, b.detach().t()) for row, end, col, stop, b in spans]

    @staticmethod
    def with_adapters(x: Tensor, base: Tensor, xa: Tensor, spans: Any, scaling: float) -> Tensor:
        out = _Plain.linear(x, base)
        for row, end, col, stop, b_t in spans:
            out[:, row:end].addmm_(xa[:, col:stop], b_t, alpha=scaling)
        return out


_Matmuls = type[_OneDNN] | type[_Plain]
_MATMULS: dict[torch.dtype, _Matmuls] = {torch.bfloat16: _OneDNN, torch.float32: _Plain}


class _Group:
    """Linear layers over one input (q/k/v, gate/up, or one alone) as one matmul on their
    stacked weights, plus their LoRA adapters: ``x A^T`` for the stacked ``A``, then its products
    with the ``B`` matrices added to the base's output (``_OneDNN``: inside the base's matmul). Packed again
    whenever one of the tensors it was made from changes (a new adapter version)."""

    def __init__(
        self,
        bases: list[Tensor],
        adapters: list[tuple[Tensor, Tensor] | None],
        scaling: float,
        matmuls: _Matmuls,
    ):
        self.bases, self.adapters, self.scaling, self.matmuls = bases, adapters, scaling, matmuls
        self.sizes = [w.shape[0] for w in bases]
        self._key: tuple[tuple[int, int], ...] | None = None
        self._held: list[Tensor] = []
        self._base: Tensor | None = None
        self._a: Tensor | None = None
        self._b: Any = None

    @staticmethod
    def of(layers: list[nn.Module], matmuls: _Matmuls) -> _Group | None:
        lora = sys.modules.get(f"{__package__}.lora")
        bases: list[Tensor] = []
        adapters: list[tuple[Tensor, Tensor] | None] = []
        scalings: set[float] = set()
        for layer in layers:
            parts = lora.plain_parts(layer) if lora is not None else None
            base = parts[0] if parts is not None else layer
            if type(base) is not matmuls.layer or base.bias is not None:
                return None
            if base.weight.dtype != matmuls.dtype:
                return None
            bases.append(base.weight)
            if parts is None:
                if lora is not None and isinstance(layer, lora.Linear):
                    return None  # a LoRA layer in a case this does not compute (dropout, several adapters)
                adapters.append(None)
                continue
            a, b, scaling = parts[1].weight, parts[2].weight, float(parts[3])
            if a.dtype != matmuls.dtype or b.dtype != matmuls.dtype:
                return None
            if matmuls.prescales and not _power_of_two(scaling):
                return None
            adapters.append((a, b))
            scalings.add(scaling)
        if len(scalings) > 1:
            return None
        return _Group(bases, adapters, scalings.pop() if scalings else 1.0, matmuls)

    def _tensors(self) -> list[Tensor]:
        return list(self.bases) + [t for pair in self.adapters if pair is not None for t in pair]

    def _sources(self) -> tuple[tuple[int, int], ...]:
        return tuple((t.data_ptr(), t._version) for t in self._tensors())

    def refresh(self) -> None:
        key = self._sources()
        if key == self._key:
            return
        with torch.no_grad():
            if self._key is None or key[: len(self.bases)] != self._key[: len(self.bases)]:
                self._base = self.matmuls.pack(torch.cat(self.bases) if len(self.bases) > 1 else self.bases[0])
            pairs = [p for p in self.adapters if p is not None]
            if pairs:
                a = torch.cat([p[0] for p in pairs]) if len(pairs) > 1 else pairs[0][0]
                spans: list[_Span] = []
                row = col = 0
                for size, pair in zip(self.sizes, self.adapters, strict=True):
                    if pair is not None:
                        rank = pair[1].shape[1]
                        spans.append((row, row + size, col, col + rank, pair[1]))
                        col += rank
                    row += size
                self._a = self.matmuls.pack(a)
                self._b = self.matmuls.adapters(spans, sum(self.sizes), self.scaling)
            self._key = key
            # their storages kept alive, so no later tensor can be given one of these addresses
            # and pass for what was packed (a swap frees the old version's adapters)
            self._held = [t.detach() for t in self._tensors()]

    def __call__(self, x: Tensor) -> Tensor:
        assert self._base is not None
        if self._a is None:
            return self.matmuls.linear(x, self._base)
        return self.matmuls.with_adapters(x, self._base, self.matmuls.linear(x, self._a), self._b, self.scaling)


def _power_of_two(x: float) -> bool:
    return x > 0 and math.frexp(x)[0] == 0.5


@dataclass
class _Block:
    norm1: tuple[Tensor, float]
    norm2: tuple[Tensor, float]
    qkv: _Group
    o: _Group
    gate_up: _Group
    down: _Group


class DecodePlan:
    """The decode step for one model (:func:`plan_for`)."""

    def __init__(
        self, module: nn.Module, blocks: list[_Block], norm: tuple[Tensor, float], heads: int, kv: int, dim: int
    ):
        self.blocks, self.norm = blocks, norm
        self.heads, self.kv, self.dim = heads, kv, dim
        self.scaling = dim**-0.5
        self.exact_scaling = _power_of_two(self.scaling)
        inner: Any = module.model
        self.embed, self.rotary = inner.embed_tokens, inner.rotary_emb
        self.head: Any = module.lm_head

    def refresh(self) -> None:
        """Repack what changed since the last step (a new version's adapters)."""
        for block in self.blocks:
            for group in (block.qkv, block.o, block.gate_up, block.down):
                group.refresh()

    @torch.no_grad()
    def step(self, tokens: Tensor, positions: Tensor, slots: KVSlots) -> Tensor:
        """Float32 logits ``[rows, vocab]`` of the token after ``tokens`` (``[rows]``, at
        ``positions`` ``[rows, 1]``): one per running row of ``slots``, in their order
        (``slots.running``); their keys and values written into the slots' next column (each
        running row attends to it)."""
        col = slots.length
        if col >= slots.capacity:
            raise ValueError(f"the KV slots are full ({slots.capacity} columns)")
        rows = tokens.shape[0]
        if rows != slots.active:
            raise ValueError(f"{rows} tokens for {slots.active} running rows")
        self.refresh()
        # the running rows are the buffers' leading ones: views, not copies
        slots.mask[:rows, col] = 0.0
        mask = slots.mask[:rows, None, None, :]
        x = self.embed(tokens)
        heads, kv, dim = self.heads, self.kv, self.dim
        groups, half = heads // kv, dim // 2
        cos, sin = self.rotary(x, positions)  # [rows, 1, dim]
        cos = cos.view(rows, 1, dim)
        # rotate_half(x) * sin is (x2, x1) * (-sin1, sin2): the same products, negated exactly
        signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], -1).view(rows, 1, dim)
        for block, all_keys, all_values in zip(self.blocks, slots.keys, slots.values, strict=True):
            keys, values = all_keys[:rows], all_values[:rows]
            qkv = block.qkv(_rms(x, *block.norm1))
            # q and k rotated in one pass, straight out of the projection's columns
            qk = _rotate(qkv[:, : (heads + kv) * dim].view(rows, heads + kv, dim), cos, signed_sin)
            keys[:, :, col] = qk[:, heads:]
            values[:, :, col] = qkv[:, (heads + kv) * dim :].view(rows, kv, dim)
            q = qk[:, :heads].reshape(rows, kv, groups, dim)
            weights = torch.matmul(q, keys.transpose(2, 3))
            if self.exact_scaling:
                # scaled and masked in one call: a power of two scales exactly, so the one
                # rounding of the sum is the two of the separate multiply and add
                weights = torch.add(mask, weights, alpha=self.scaling)
            else:
                weights = weights * self.scaling + mask
            weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(x.dtype)
            out = torch.matmul(weights, values).view(rows, heads * dim)
            x = x + block.o(out)
            gate_up = block.gate_up(_rms(x, *block.norm2))
            half_up = gate_up.shape[1] // 2
            x = x + block.down(F.silu(gate_up[:, :half_up]) * gate_up[:, half_up:])
        slots.length = col + 1
        return self.head(_rms(x, *self.norm)).float()


def _rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin``, each product rounded, then the sum:
    ``x`` ``[rows, heads, dim]``, ``cos`` and ``signed_sin`` (``sin`` with its first half
    negated) ``[rows, 1, dim]``."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], -1)
    return (x * cos).add_(swapped * signed_sin)

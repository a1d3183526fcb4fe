"""The LM head of a model loaded in a low precision, with float32 logits.

Why: a bfloat16 logit of 8-16 has a step of 0.0625, so two matmuls that accumulate the same
products in another order (the sampler decoding 64 rows, the learner 3,000) can round one
token's logit a whole step apart, and its logprob with it. The sampler and the learner both
call this module (the sampler's copy on prepacked weights, ``fast_decode.speed_up``): on SmolLM2
the sampler-learner mean k3 KL fell from 1.0e-3 to below 1e-3 (benchmarks/RESULTS.md, "Numerics
on AMX").

Three ways to the same float32 logits, the first that applies:

- a bfloat16 model on a CPU with bfloat16 matrix units where torch's micro-kernel runs: its
  batch-reduce GEMM on bfloat16 ``x`` and ``W``, its float32 sums written as they are
  (``brgemm.py``, the column blocks shared among the torch threads). It reads a repacked
  bfloat16 copy of the weight (kept while the weight is unchanged) and takes about half the time
  of the next way at one thread (benchmarks/RESULTS.md, "The head on the micro-kernel"; at two,
  inside a generation, the gain mostly goes to spinning OpenMP workers: "A Zen 4 host");
- the same without the micro-kernel: one matmul of float32 copies of ``x`` and ``W`` with oneDNN told
  to multiply float32 on the bfloat16 units (``fp32_precision="bf16"``). The copies hold
  bfloat16 values, so that conversion is exact and the products accumulate in float32 (~1e-6
  from float64 arithmetic). It reads a float32 copy of the weight (+4 bytes a parameter) and
  costs ~0.6-0.7x the two matmuls below (benchmarks/RESULTS.md, "The head in one matmul");
- anywhere else (a GPU, float16, no bfloat16 units): ``r = x W^T`` rounded to the low
  precision, then the rounding error ``x W^T - r``, accumulated in float32 and rounded on its own
  (``addmm(-r, x, W^T)``), added back in float32: ~3e-5, at twice the plain head's cost.

The first two agree to ~1e-6, not bit for bit (their sums run in other orders); the sampler and
the learner take the same way in one process, so their logits do agree bit for bit.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .brgemm import bf16_units, products, usable
from .brgemm import pack as pack_blocks


def float32_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in float32 from low-precision ``x`` and ``weight`` (2-D ``x``; float32
    ones: the plain matmul)."""
    if weight.dtype == torch.float32:
        return x @ weight.t()
    if micro_kernel(x, weight):
        return products(x, _cached(_BLOCKS, weight, pack_blocks), weight.shape[0])
    if one_matmul(x, weight):
        wide = _cached(_COPIES, weight, torch.Tensor.float)
        with _products_on_bf16_units():
            return x.float() @ wide.t()
    rounded = x @ weight.t()
    # bf16(x W^T - r), the sum taken in float32; beta=-1 rather than a negated copy of r, and r
    # added to the upcast error in place (one float32 copy, not two): the same bits
    # (tests/test_torch_layers.py)
    error = torch.addmm(rounded, x, weight.t(), beta=-1)
    return error.float().add_(rounded)


def float32_logits_prepacked(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """:func:`float32_logits`' one matmul (where :func:`one_matmul`) on a float32 copy of the
    weight packed once for oneDNN (:func:`pack_float32`): the same bits, without oneDNN
    reordering the whole float32 weight at every call (SmolLM2's head at 64 rows: ~15% of its
    time)."""
    with _products_on_bf16_units():
        return torch.ops.mkldnn._linear_pointwise(x.float(), packed, None, "none", [], "")


def pack_float32(weight: torch.Tensor) -> torch.Tensor:
    """``weight``'s float32 copy in oneDNN's packed layout, for :func:`float32_logits_prepacked`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), 64)


def micro_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the float32 logits of ``x`` and ``weight`` take torch's micro-kernel
    (``brgemm.py``: bfloat16 units, the kernel tried here)."""
    return usable(x, weight)


def one_matmul(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the float32 logits of ``x`` and ``weight`` take the one float32 matmul on the
    bfloat16 units (else the two low-precision ones)."""
    return x.device.type == "cpu" and x.dtype == weight.dtype == torch.bfloat16 and bf16_units()


# id(weight) -> (its (data_ptr, version) when copied, the tensor copied, the copy), dropped with
# the weight (tensors compare by value: they cannot key a WeakKeyDictionary): its float32 copy
# (_COPIES) or its copy packed for the micro-kernel (_BLOCKS). The tensor copied is held so that
# no later tensor can be given its address and pass for it (a version swap points the parameter
# at new storage and frees the old).
_Copies = dict[int, tuple[tuple[int, int], torch.Tensor, torch.Tensor]]
_COPIES: _Copies = {}
_BLOCKS: _Copies = {}


def _cached(store: _Copies, weight: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    key = (weight.data_ptr(), weight._version)
    held = store.get(id(weight))
    if held is None:
        weakref.finalize(weight, store.pop, id(weight), None)
    if held is None or held[0] != key:
        source = weight.detach()
        held = (key, source, make(source))
        store[id(weight)] = held
    return held[2]


# the precision is process-wide in torch: the lock keeps two heads on two threads from restoring
# it under each other. A float32 matmul another thread runs meanwhile would take it too; in
# headrace a model's work all runs on its backend's one device thread, and a float32 model
# never comes here.
_PRECISION = threading.Lock()


@contextlib.contextmanager
def _products_on_bf16_units() -> Iterator[None]:
    with _PRECISION:
        before = torch._C._get_fp32_precision_getter("mkldnn", "matmul")
        torch._C._set_fp32_precision_setter("mkldnn", "matmul", "bf16")
        try:
            yield
        finally:
            torch._C._set_fp32_precision_setter("mkldnn", "matmul", before)


class _Float32Logits(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return float32_logits(x, weight)

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

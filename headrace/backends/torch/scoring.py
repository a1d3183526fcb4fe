"""The target tokens' logprobs under the trained weights and under the frozen reference: what
every training call computes first, whatever loss follows.

Memory: the LM head runs only where the loss reads it (mask != 0) with a gradient; every other
position's logprob (a forward returns them all: Tinker's does) is computed without one, a chunk
at a time. Microbatches hold a token budget, not a datum count.

Reference (``loss.kl_coef > 0``, DPO's π_ref): the base model with the LoRA adapter disabled
(peft's ``disable_adapter()``), or for full fine-tuning a copy of the initial weights built by
``reference_model`` on first use; nothing is built or run until one is asked for.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from headrace.core import logs
from headrace.core.types import Datum

from .batches import Batch, microbatches, pack, pad, tree, tree_microbatches, trees
from .head import Float32LogitsHead, float32_logits
from .model import body_and_head

# torch.microbatch_size = 0 sizes microbatches by tokens. The body's saved activations dominate
# memory (about 3 MB a token on SmolLM2-135M, in proportion to hidden size x layers), so a pass
# holds at most ACTIVATION_BUDGET // (hidden x layers) padded tokens: 485 on SmolLM2 (peak RSS
# 2.8 GB for 64 x 66 tokens with LoRA, as fast as 2048 tokens a pass at 4.5x the memory), the
# whole batch on the tiny model. LOGITS_BUDGET caps loss-position logits (256 MiB in fp32).
ACTIVATION_BUDGET = 1 << 23
MIN_MICROBATCH_TOKENS = 128
LOGITS_BUDGET = 1 << 26

log = logs.get_logger()


class Scorer:
    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        pad_token_id: int,
        microbatch_size: int = 0,
        reference_model: Callable[[], nn.Module] | None = None,
        share_prefix: bool = True,
    ):
        self.model, self.device, self.pad_token_id = model, device, pad_token_id
        self.microbatch_size = microbatch_size
        # a 4-D mask replaces the model's own masks, so a model with sliding-window layers (whose
        # masks transformers builds) keeps its padded rows
        self.share_prefix = share_prefix and _full_attention_only(getattr(model, "config", None))
        self.vocab_size = int(getattr(model.config, "vocab_size", 0) or 0)
        self.body, self.head = body_and_head(model)
        width = math.prod(int(getattr(model.config, k, 0) or 0) for k in ("hidden_size", "num_hidden_layers"))
        self.microbatch_tokens = max(MIN_MICROBATCH_TOKENS, ACTIVATION_BUDGET // max(width, 1))
        # full fine-tuning: builds the frozen reference (the initial weights) when first asked
        self.reference_model = reference_model
        self.reference: tuple[nn.Module, Any, Any] | None = None

    def batches(self, datums: Sequence[Datum], packed: bool = False) -> Iterator[tuple[list[int], Batch]]:
        """The datums' forward passes: (their indices, the batch's tensors)."""
        max_loss = LOGITS_BUDGET // max(self.vocab_size, 1)
        if self.share_prefix and not packed and not self.microbatch_size and self.body is not None:
            dtype = self.model.get_input_embeddings().weight.dtype  # type: ignore[operator]
            groups = trees(datums, self.microbatch_tokens)
            for chunk in tree_microbatches(groups, datums, self.microbatch_tokens, max_loss):
                yield [i for g in chunk for i in g.members], tree(chunk, datums, self.pad_token_id, self.device, dtype)
            return
        for idx in microbatches(datums, self.microbatch_size, self.microbatch_tokens, max_loss, packed):
            chosen = [datums[i] for i in idx]
            if not packed:
                yield idx, pad(chosen, self.pad_token_id, self.device)
                continue
            # rows as long as the pass's budget allows: the pass's datums in as few rows as fit, no
            # padding between them (rows of the longest datum would pad as much as one a row does
            # once the microbatches are sorted by length)
            width = min(sum(len(d.model_input) for d in chosen), self.microbatch_tokens)
            yield idx, pack(chosen, self.pad_token_id, self.device, width)

    def has_reference(self) -> bool:
        return hasattr(self.model, "disable_adapter") or self.reference_model is not None

    def target_logprobs(self, batch: Batch) -> torch.Tensor:
        """``[rows, time]`` logprobs of the targets. The LM head runs on the hidden states of the
        loss positions (mask != 0) only, so full-vocabulary logits with a gradient exist for those
        alone; every other position gets its logprob without a gradient, a chunk at a time."""
        return self._logprobs(self.model, self.body, self.head, batch, grad_at=batch["mask"] != 0)

    def reference_logprobs(self, batch: Batch) -> torch.Tensor:
        """``[rows, time]`` logprobs of the targets under the frozen reference, at the loss
        positions (0 elsewhere), without a gradient."""
        disable_adapter = getattr(self.model, "disable_adapter", None)  # peft: the base model itself
        if disable_adapter is not None:
            model, body, head = self.model, self.body, self.head
            context: Any = disable_adapter()
        else:
            model, body, head = self._reference_parts()
            context = contextlib.nullcontext()
        with torch.no_grad(), context:
            loss_at = batch["mask"] != 0
            logp = self._logprobs(model, body, head, batch, grad_at=loss_at, rest=False)
            return torch.where(loss_at, logp, torch.zeros_like(logp))

    def _logprobs(
        self, model: Any, body: Any, head: Any, batch: Batch, grad_at: torch.Tensor, rest: bool = True
    ) -> torch.Tensor:
        target = batch["target"]
        # no KV cache: nothing decodes after this pass (a cache would copy every layer's keys and
        # values into it); packed rows: position ids that restart at each datum (transformers'
        # packed-sequence mask, which also needs no cache)
        extra: dict[str, Any] = {"use_cache": False}
        if "position_ids" in batch:
            extra["position_ids"] = batch["position_ids"]
        if body is None:  # a head this code cannot call alone: the model's own forward
            logits = model(input_ids=batch["input"], **extra).logits.float()
            return logits.log_softmax(-1).gather(-1, target[..., None]).squeeze(-1)
        if "tree" in batch:  # shared prefixes: the rows the body runs, gathered back into the padded layout
            t = batch["tree"]
            mask, positions = t["attention_mask"], t["position_ids"]
            out = body(input_ids=t["input"], position_ids=positions, attention_mask=mask, use_cache=False)
            hidden = out.last_hidden_state[t["gather"]]
        else:
            hidden = body(input_ids=batch["input"], **extra).last_hidden_state
        logp = torch.zeros(target.shape, dtype=torch.float32, device=target.device)
        logp = logp.masked_scatter(grad_at, _head_logprobs(head, hidden[grad_at], target[grad_at]))
        if not rest:
            return logp
        rows, cols = (~grad_at & batch["real"]).nonzero(as_tuple=True)  # padding needs none
        states, targets, inverse = hidden[rows, cols], target[rows, cols], None
        if "tree" in batch and len(rows):
            # a shared prefix's positions have one hidden state and, but at its last, one target
            # for all the group's datums: the head runs once for each (slot, target)
            slot_rows, slots = (g[rows, cols] for g in batch["tree"]["gather"])
            key = (slot_rows * batch["tree"]["input"].shape[1] + slots) * max(self.vocab_size, 1) + targets
            _, first, inverse = _unique_first(key)
            states, targets = states[first], targets[first]
        step = max(1, LOGITS_BUDGET // max(self.vocab_size, 1))
        others = []
        with torch.no_grad():
            for s in range(0, len(states), step):
                others.append(_head_logprobs(head, states[s : s + step], targets[s : s + step], precise=False))
        if not others:
            return logp
        values = torch.cat(others)
        return logp.index_put((rows, cols), values if inverse is None else values[inverse])

    def _reference_parts(self) -> tuple[nn.Module, Any, Any]:
        if self.reference is None:
            if self.reference_model is None:
                raise ValueError(
                    "loss.kl_coef > 0 needs a frozen reference model, and this trainer has neither a LoRA adapter to "
                    "disable nor a way to rebuild the initial weights (reference_model); set loss.kl_coef=0"
                )
            ref = self.reference_model().to(self.device)
            ref.eval()
            ref.requires_grad_(False)
            body, head = body_and_head(ref)
            self.reference = (ref, body, head)
            log.info("reference_model_built", params=sum(p.numel() for p in ref.parameters()))
        return self.reference


def _full_attention_only(config: Any) -> bool:
    kinds = getattr(config, "layer_types", None) or ()
    return not getattr(config, "use_sliding_window", False) and all(k == "full_attention" for k in kinds)


_SCRATCH = threading.local()


def _scratch(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A ``shape`` tensor over one buffer per thread, dtype and device, kept between calls (grown
    as needed), for a temporary that never leaves its caller."""
    buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = _SCRATCH.__dict__.setdefault("buffers", {})
    n = math.prod(shape)
    held = buffers.get((dtype, device))
    if held is None or held.numel() < n:
        held = buffers[(dtype, device)] = torch.empty(n, dtype=dtype, device=device)
    return held[:n].view(shape)


def _unique_first(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``key``'s distinct values, the index of one occurrence of each, and each element's value's index."""
    values, inverse = torch.unique(key, return_inverse=True)
    first = torch.empty(len(values), dtype=torch.long, device=key.device)
    first.scatter_(0, inverse, torch.arange(len(key), device=key.device))
    return values, first, inverse


def _head_logprobs(head: Any, hidden: torch.Tensor, target: torch.Tensor, precise: bool = True) -> torch.Tensor:
    """``precise=False``: positions outside the loss (the prompt's, only reported) take the plain
    low-precision product of a float32-logits head: its second matmul costs ~1 s of a SmolLM2
    bfloat16 pass there (benchmarks/RESULTS.md, "Numerics on AMX")."""
    if isinstance(head, Float32LogitsHead) or _wide_float32(head):
        if not precise:
            return TargetLogprobs.apply(torch.nn.functional.linear(hidden, head.weight), target)
        if torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad):
            return HeadTargetLogprobs.apply(hidden, head.weight, target)
    logits = head(hidden)
    if logits.dtype == torch.float32 and not isinstance(head, Float32LogitsHead):
        return logits.log_softmax(-1).gather(-1, target[:, None]).squeeze(-1)
    return TargetLogprobs.apply(logits, target)


# from this vocabulary up, a plain float32 head's logprobs take the fused, chunked path: a
# log-softmax of the whole [rows, vocab] writes it out and its backward zero-fills and reads
# [rows, vocab] twice (SmolLM2 float32: a training pass 1.03-1.05x faster without, RESULTS.md
# "Float32 where the CPU has no bfloat16 units"); a small vocabulary's [rows, vocab] is one cheap call
WIDE_VOCAB = 4096


def _wide_float32(head: Any) -> bool:
    return (
        type(head) is nn.Linear
        and head.bias is None
        and head.weight.dtype == torch.float32
        and head.weight.shape[0] >= WIDE_VOCAB
    )


# rows of float32 logits upcast at once: a few rows of a 49k vocabulary stay in the core's cache
LSE_ROWS = 8


def _log_softmax_rows(logits: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(start, end, log_softmax(logits[start:end].float()))`` for ``LSE_ROWS`` rows at a time,
    each chunk's in the same float32 buffer (overwritten by the next). Log-softmax's own kernel
    row by row, so the bits of the sampler's log-softmax of the same logits (its rows do not
    depend on the rows beside them). A fresh ``[8, vocab]`` temporary per chunk came from pages the
    allocator had just given back, and their faults cost more than the arithmetic."""
    rows, vocab = logits.shape
    shape = (min(rows, LSE_ROWS), vocab)
    buf = torch.empty(shape, dtype=torch.float32, device=logits.device)
    wide = None if logits.dtype == torch.float32 else torch.empty(shape, dtype=torch.float32, device=logits.device)
    for s in range(0, rows, LSE_ROWS):
        e = min(s + LSE_ROWS, rows)
        chunk = logits[s:e] if wide is None else wide[: e - s].copy_(logits[s:e])
        yield s, e, torch.log_softmax(chunk, -1, out=buf[: e - s])


def _target_logprobs(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits.float()).gather(-1, target)`` of ``[rows, vocab]`` logits, a few rows
    at a time: its bits, without the whole ``[rows, vocab]`` log-softmax written out. (A logsumexp
    taken apart, ``x - lse``, put the learner ~9e-6 below the sampler on average on SmolLM2 in
    float32: a summation in another order and two numbers of the logits' size subtracted.)"""
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for s, e, logprobs in _log_softmax_rows(logits):
        torch.gather(logprobs, -1, target[s:e, None], out=out[s:e, None])
    return out


def _logits_grad_rows(
    logits: torch.Tensor, target: torch.Tensor, grad: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``out`` (``[rows, vocab]``, any dtype) = ``grad * (onehot(target) - softmax)`` with the
    softmax ``exp(log_softmax)`` as log-softmax's backward takes it, computed in float32 a few
    rows at a time and written in ``out``'s dtype."""
    for s, e, logprobs in _log_softmax_rows(logits):
        g = grad[s:e, None].float()
        out[s:e] = logprobs.exp_().mul_(-g).scatter_add_(-1, target[s:e, None], g)
    return out


class TargetLogprobs(torch.autograd.Function):
    """``log_softmax(logits.float())[target]`` of low-precision logits ``[rows, vocab]``, a few rows
    at a time: the sampler's float32 log-softmax of the same logits, bit for bit, without a
    float32 copy of the whole ``[rows, vocab]`` nor its log-softmax written out (SmolLM2,
    bfloat16, 512 rows: a forward+backward about 3x faster, benchmarks/RESULTS.md "Mixed precision
    on AMX"). The gradient, ``g * (onehot - softmax)``, is rebuilt from the saved logits, in the
    logits' dtype (what autograd would cast it to anyway)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, target)
        return _target_logprobs(logits, target)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, target = ctx.saved_tensors
        return _logits_grad_rows(logits, target, grad, torch.empty_like(logits)), None


class HeadTargetLogprobs(torch.autograd.Function):
    """``TargetLogprobs`` of a float32-logits head (``head.py``), or of a plain float32 head over a
    wide vocabulary, in one function: the gradient of the logits is written in the weight's dtype
    a few rows at a time, straight from the saved float32 logits, where the two functions apart
    wrote it in float32 and then cast the whole ``[rows, vocab]`` to bfloat16 for the head's own
    backward. The same bits (tests/test_torch_kernels.py)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = float32_logits(hidden, weight)
        ctx.save_for_backward(hidden, weight, logits, target)
        return _target_logprobs(logits, target)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        hidden, weight, logits, target = ctx.saved_tensors
        # the logits' gradient lives only here: a buffer kept from the last call, not fresh pages
        g_logits = _scratch(logits.shape, weight.dtype, logits.device)
        _logits_grad_rows(logits, target, grad, g_logits)
        grad_x = g_logits @ weight if ctx.needs_input_grad[0] else None
        grad_w = g_logits.t() @ hidden if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None

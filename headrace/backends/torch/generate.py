"""Batched sampling with a KV cache: one prefill of the left-padded prompts, then one forward
per new token for the whole batch. Runs on the device thread.

Shared prefixes: a group's rows share one prompt, so each distinct prompt is prefilled once and
its KV cache (and last logits) copied to its rows before decoding: 8 prompts of 43 tokens x 8
rows x 16 tokens on SmolLM2-135M (one CPU thread) sample in 6.6 s instead of 13.2 s. The
leading tokens all the distinct prompts share (a chat template's system prompt: 27 of SmolLM2's
43 there) are forwarded once for all of them, where that spares enough tokens to pay for the
extra forward (``SHARED_PREFIX_SAVES``); the logits are the same bits on that job.

Logprob convention: each sampled token is reported with its logprob under the model's plain
distribution, ``log_softmax(logits)`` at temperature 1 with no top-k/top-p filtering: exactly
what the learner's forward pass computes for the same token. Temperature, top-k and top-p only
shape which token is drawn. (With temperature 1 and no filtering, that is the true sampling
distribution; otherwise the importance ratio in the losses is taken against the unshaped
model, as Tinker's samplers report it.)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from headrace.core.types import StopReason

from .decode_step import DecodePlan, plan_for
from .draw import Shaping
from .flops import ModelShape, PerfMeter, causal_pairs
from .slots import KVSlots


@dataclass
class Row:
    """One sequence to sample. Rows of one request are adjacent and share its generator."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stops: frozenset[int]
    generator: torch.Generator


@dataclass
class RowResult:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    versions: tuple[int, ...] = ()  # the weights version that drew each token


class Member:
    """The rows of one request (or of one part of it) in a batch: they join it together and leave
    it together, once every one has ended (or the request was cancelled). What each row drew is
    kept here, on the host, so a member leaves a batch at any step with its own results."""

    def __init__(self, tag: Any, rows: list[Row]):
        self.tag = tag
        self.rows = rows
        self.tokens: list[list[int]] = [[] for _ in rows]
        self.logprobs: list[list[float]] = [[] for _ in rows]
        self.versions: list[list[int]] = [[] for _ in rows]
        self.stopped = [False] * len(rows)
        self.ended = [r.max_tokens <= 0 for r in rows]

    @property
    def over(self) -> bool:
        return all(self.ended)

    def results(self) -> list[RowResult]:
        return [
            RowResult(t, lp, StopReason.STOP if s else StopReason.LENGTH, tuple(v))
            for t, lp, s, v in zip(self.tokens, self.logprobs, self.stopped, self.versions, strict=True)
        ]


class Generator:
    def __init__(
        self,
        model: nn.Module,
        pad_token_id: int,
        device: torch.device,
        meter: PerfMeter | None = None,
        decode_step: bool = True,
    ):
        self.model = model
        self.pad_token_id = pad_token_id
        self.device = device
        self.meter = meter  # FLOPs per forward, as prefill or decode
        self._shape = ModelShape.of(model) if meter is not None else None
        params = inspect.signature(model.forward).parameters
        # transformers 5.x renamed past_key_values to cache
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # the decode step written out, where the model is one it computes (else transformers')
        self.plan: DecodePlan | None = plan_for(model) if decode_step else None

    def _count(self, rows: int, new: int, width: int) -> None:
        """The FLOPs of a forward of ``new`` positions per row against ``width`` columns in all."""
        if self.meter is not None:
            assert self._shape is not None
            pairs = rows * new * (width - new) + causal_pairs(rows, new)
            kind = "decode" if new == 1 else "prefill"
            self.meter.add(kind, flops=self._shape.forward(rows * new, pairs, rows), rows=rows)

    def _forward(self, ids: Tensor, mask: Tensor, pos: Tensor, cache):
        rows, new = ids.shape
        self._count(rows, new, mask.shape[1])
        kwargs = {self._cache_kw: cache}
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1, **kwargs
        )
        next_cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
        return out.logits[:, -1, :].float(), next_cache

    def _prefill(self, rows: list[Row], room: int = 0) -> tuple[Tensor, Any, Tensor, Tensor, KVSlots | None]:
        """Logits after each row's prompt, the cache, the attention mask and the last positions,
        computed once per distinct prompt and then indexed out to the rows; the leading tokens
        all distinct prompts share (a chat template's system prompt) once for all of them.
        ``room`` > 0 where the decode step can take the batch: the cache is copied to the rows
        straight into :class:`KVSlots` with that many more columns (returned; the cache's layers
        are then views of them), not first into a cache of its own."""
        dev = self.device
        distinct: dict[tuple[int, ...], int] = {}
        of_row = [distinct.setdefault(tuple(r.prompt), len(distinct)) for r in rows]
        prompts = list(distinct)
        shared = _shared_prefix(prompts)
        cache = None
        if shared:
            head = torch.tensor([prompts[0][:shared]], dtype=torch.long, device=dev)
            _, cache = self._forward(head, torch.ones_like(head), torch.arange(shared, device=dev)[None, :], None)
            cache.batch_select_indices(torch.zeros(len(prompts), dtype=torch.long, device=dev))
        # each prompt's own tokens right-aligned after the shared ones, padding between them masked
        longest = max(len(p) for p in prompts) - shared
        ids = torch.full((len(prompts), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), shared + longest), dtype=torch.long)
        mask[:, :shared] = 1
        for i, p in enumerate(prompts):
            own = len(p) - shared
            ids[i, longest - own :] = torch.tensor(p[shared:], dtype=torch.long)
            mask[i, shared + longest - own :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits, cache = self._forward(ids, mask, pos[:, shared:], cache)
        index = torch.tensor(of_row, dtype=torch.long, device=dev) if len(prompts) < len(rows) else None
        if index is not None:
            logits, mask, pos = logits[index], mask[index], pos[index]
        slots = None
        if room > 0 and self.plan is not None and _pads(cache):
            slots = KVSlots.of(cache, mask, room, index)
            slots.settle(cache)
        elif index is not None:
            cache.batch_select_indices(index)  # a copy per row: rows then decode independently
        return logits, cache, mask, pos[:, -1:], slots

    @torch.no_grad()
    def generate(self, rows: list[Row]) -> list[RowResult]:
        member = Member(None, rows)
        Generation(self, [member]).advance(None)
        return member.results()


class Generation:
    """A batch of rows sampled a few decode steps at a time (``advance``), so the device can run
    other work between steps, that members join (``absorb``: continuous batching) and leave (as
    they end, or ``drop``) between two steps, and that takes new weights between two steps
    (``reweigh``): the tokens drawn after it come from the new weights, and each token records
    the version that drew it. ``Generator.generate`` runs one to the end in a single call.

    Layout: the cache, the attention mask and the last position are per row, each row's tokens
    right-aligned (its last token in the last column) with padding on the left, masked out (or,
    after a prefix shared by all prompts, between that prefix and the row's own tokens).
    Members that join are prefilled on their own (one forward per distinct prompt: a group's
    rows share it) and the two batches' caches are then padded on the left to the same length
    and concatenated; rows that leave are removed from the cache, and columns that no remaining
    row uses are cut off the left. Positions are each row's own (``position_ids``), so a row
    computes the same logits, up to float round-off, whichever rows it shares a batch with and
    whenever it joined (``tests/test_torch_continuous.py``).

    A weight swap must also redo the logits of the next token, which the old weights computed
    from the last token forwarded. ``reweigh`` either recomputes the whole KV cache under the new
    weights (``"recompute"``: the rows' prompts prefilled once each again, then every row's tokens
    so far in one pass, right-aligned, masked where a row has drawn fewer than the longest), so
    a post-swap token is exactly what the new weights would sample from scratch; or keeps the
    cache as PipelineRL does (``"keep"``: only the last token is forwarded again), so post-swap
    tokens attend to keys and values the old weights made (benchmarks/RESULTS.md, "In-flight
    updates", measures both)."""

    def __init__(self, generator: Generator, members: list[Member], version: int = -1):
        self.g, self.version = generator, version
        self.members: list[Member] = list(members)
        self.step = 0  # decode steps this batch has run (a token drawn for each of its rows)
        self._logits: Tensor | None = None  # the next token's logits per row; None until the prefill
        self._cache: Any = None
        # the cache in the decode step's buffers (the plan's); None: in ``_cache`` alone
        self._slots: KVSlots | None = None
        self._mask = self._pos = self._last = torch.empty(0)
        self._layout()

    def _layout(self) -> None:
        self.rows: list[Row] = [r for m in self.members for r in m.rows]
        # a request's generator draws one uniform per row and step from the step it joined to the
        # one it leaves, so its stream never depends on the rows beside it
        self._shaping = Shaping(self.rows, self.g.device) if self.rows else None

    @property
    def done(self) -> bool:
        return not self.members

    @property
    def started(self) -> bool:
        return self._logits is not None

    def _start(self) -> None:
        if self._logits is None and self.members:
            room = max(r.max_tokens for r in self.rows)  # the first decode step's, at most
            self._logits, self._cache, self._mask, self._pos, self._slots = self.g._prefill(self.rows, room)
            last = [r.prompt[-1] for r in self.rows]
            self._last = torch.tensor(last, dtype=torch.long, device=self.g.device)

    @torch.no_grad()
    def advance(self, steps: int | None) -> list[Member]:
        """Draw up to ``steps`` more tokens per row (None: to the end); the members whose rows
        have all ended meanwhile, which leave the batch (``done`` once none is left)."""
        g, dev = self.g, self.g.device
        left = [m for m in self.members if m.over]  # max_tokens 0: nothing to draw
        if left:
            self.drop(left)
        self._start()
        taken = 0
        while self.members and (steps is None or taken < steps):
            assert self._logits is not None and self._shaping is not None
            token, logprob = self._shaping.draw(self._logits)
            # one host sync per token: each row's bookkeeping is then plain Python
            drawn, logprobs = token.tolist(), logprob.tolist()
            taken += 1
            feed, at, over, ended = [], 0, [], []
            for m in self.members:
                for j, row in enumerate(m.rows):
                    t = drawn[at]
                    at += 1
                    if m.ended[j]:
                        # an ended row stays in the batch until its member leaves (the decode
                        # step's slots no longer compute it; transformers' forward does)
                        feed.append(g.pad_token_id)
                        continue
                    m.tokens[j].append(t)
                    m.logprobs[j].append(logprobs[at - 1])
                    m.versions[j].append(self.version)
                    if t in row.stops:
                        m.ended[j] = m.stopped[j] = True
                    elif len(m.tokens[j]) >= row.max_tokens:
                        m.ended[j] = True
                    if m.ended[j]:
                        ended.append(at - 1)
                    feed.append(t)
                if m.over:
                    over.append(m)
            self.step += 1
            if self._slots is not None:
                self._slots.retire(ended)  # the decode step computes the running rows only
            if over:
                keep = self._keep_index(over)
                feed = [feed[i] for i in keep]
                self.drop(over)
                left += over
                if not self.members:
                    break
            ids = torch.tensor(feed, dtype=torch.long, device=dev)
            B = len(feed)
            self._mask = torch.cat([self._mask, torch.ones((B, 1), dtype=self._mask.dtype, device=dev)], dim=1)
            self._pos = self._pos + 1
            self._last = ids
            self._decode(ids)
        return left

    def _decode(self, ids: Tensor) -> None:
        """The logits after ``ids`` (each row's new last token; ``_mask`` and ``_pos`` already
        include it): the plan's step on the batch's KV slots where there is a plan (made from the
        cache when there are none, or they are full), else transformers' forward."""
        g = self.g
        if g.plan is None or not _pads(self._cache):
            self._logits, self._cache = g._forward(ids[:, None], self._mask, self._pos, self._cache)
            return
        if self._slots is not None and self._slots.length >= self._slots.capacity:
            self._settle()
        if self._slots is None:
            # every row takes a column per step until the batch's last running row has drawn its
            # last token (which is not fed): the one fed now, and one per token still to draw
            room = max(
                (
                    row.max_tokens - len(m.tokens[j])
                    for m in self.members
                    for j, row in enumerate(m.rows)
                    if not m.ended[j]
                ),
                default=1,
            )
            self._slots = KVSlots.of(self._cache, self._mask[:, :-1], room)
            ended = [i for i, done in enumerate(d for m in self.members for d in m.ended) if done]
            self._slots.retire(ended)
        running = self._slots.running()
        g._count(len(running), 1, self._mask.shape[1])
        if running == list(range(len(ids))):  # every row runs, each in its own slot
            self._logits = g.plan.step(ids, self._pos, self._slots)
            return
        # the running rows' logits; an ended row's are not read again (it draws, but is fed padding)
        index = torch.tensor(running, dtype=torch.long, device=ids.device)
        assert self._logits is not None
        self._logits.index_copy_(0, index, g.plan.step(ids[index], self._pos[index], self._slots))

    def _settle(self) -> None:
        """The cache back in ``_cache`` alone (views of the slots' written columns), before
        anything else reads or reshapes it."""
        if self._slots is not None:
            self._slots.settle(self._cache)
            self._slots = None

    def _keep_index(self, leaving: list[Member]) -> list[int]:
        gone = {id(m) for m in leaving}
        keep: list[int] = []
        at = 0
        for m in self.members:
            if id(m) not in gone:
                keep += range(at, at + len(m.rows))
            at += len(m.rows)
        return keep

    def drop(self, leaving: list[Member]) -> None:
        """Take ``leaving`` out of the batch between two steps (ended, or nobody waits for them):
        the others go on exactly as they would have."""
        if not leaving:
            return
        keep = self._keep_index(leaving)
        if self._slots is not None and keep:
            # out of the decode step's slots without copying the others' (their rows renumbered)
            running, kept = set(self._slots.running()), set(keep)
            self._slots.retire([r for r in range(len(self.rows)) if r not in kept and r in running])
            self._slots.renumber(keep)
        elif keep:
            self._settle()
        # none kept: the cache goes as it is (settling it would copy every layer's keys and
        # values, when the batch's last rows end, for nobody to read)
        gone = {id(m) for m in leaving}
        self.members = [m for m in self.members if id(m) not in gone]
        self._layout()
        if self._logits is None:
            return
        if not keep:
            self._logits, self._cache, self._slots = None, None, None
            self._mask = self._pos = self._last = torch.empty(0)
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.g.device)
        self._logits, self._mask, self._pos, self._last = (
            self._logits[index],
            self._mask[index],
            self._pos[index],
            self._last[index],
        )
        if self._slots is not None:
            return  # the cache is the slots' until they settle
        self._cache.batch_select_indices(index)
        unused = int(self._mask.any(0).long().argmax())  # leading columns no remaining row attends to
        if unused > 0 and _trims(self._cache):
            _cut_left(self._cache, unused)
            self._mask = self._mask[:, unused:]

    def can_absorb(self, other: Generation) -> bool:
        """Whether ``other`` can join this batch (the same weights, a cache that can be padded)."""
        if other.version != self.version:
            return False
        return all(_pads(c) for c in (self._cache, other._cache) if c is not None)

    @torch.no_grad()
    def absorb(self, other: Generation) -> None:
        """``other``'s members join this batch between two steps (prefilled first, under the
        weights in place, which must be this batch's version)."""
        if not other.members:
            return
        self._start()
        other._start()
        self._settle()
        other._settle()
        if not self.members:
            self._logits, self._cache, self._mask, self._pos, self._last = (
                other._logits,
                other._cache,
                other._mask,
                other._pos,
                other._last,
            )
            self.members, other.members = other.members, []
            self._layout()
            return
        a, b = self._mask.shape[1], other._mask.shape[1]
        width = max(a, b)
        for gen, length in ((self, a), (other, b)):
            if length < width:
                _pad_left(gen._cache, width - length)
                zeros = torch.zeros((gen._mask.shape[0], width - length), dtype=gen._mask.dtype, device=self.g.device)
                gen._mask = torch.cat([zeros, gen._mask], dim=1)
        _concat(self._cache, other._cache)
        assert self._logits is not None and other._logits is not None
        self._logits = torch.cat([self._logits, other._logits])
        self._mask = torch.cat([self._mask, other._mask])
        self._pos = torch.cat([self._pos, other._pos])
        self._last = torch.cat([self._last, other._last])
        self.members += other.members
        other.members = []
        self._layout()

    @torch.no_grad()
    def reweigh(self, version: int, mode: str) -> bool:
        """The model's weights were just changed to ``version``: redo what the next token is drawn
        from (``mode``: ``"recompute"`` the KV cache, or ``"keep"`` it). False: nothing to redo
        (not prefilled yet, the new weights will; or over)."""
        if mode not in SWAP_MODES:
            raise ValueError(f"unknown swap mode {mode!r}; use one of {', '.join(SWAP_MODES)}")
        self.version = version
        if self._logits is None or not self.members:
            return False
        self._settle()
        g, dev = self.g, self.g.device
        if mode == "recompute":
            logits, cache, mask, pos, _ = g._prefill(self.rows)
            drawn = [t for m in self.members for t in m.tokens]
            longest = max(len(t) for t in drawn)
            if longest:
                B = len(drawn)
                ids = torch.full((B, longest), g.pad_token_id, dtype=torch.long)
                fill = torch.zeros((B, longest), dtype=mask.dtype)
                for i, t in enumerate(drawn):
                    if t:
                        ids[i, longest - len(t) :] = torch.tensor(t, dtype=torch.long)
                        fill[i, longest - len(t) :] = 1
                ids, fill = ids.to(dev), fill.to(dev)
                counts = fill.sum(-1, keepdim=True)
                # each row's tokens at its own positions after its prompt; the padding before them is masked
                positions = (pos + 1 + torch.arange(longest, device=dev)[None, :] - (longest - counts)).clamp(min=0)
                mask = torch.cat([mask, fill], dim=1)
                after, cache = g._forward(ids, mask, positions, cache)
                logits = torch.where(counts > 0, after, logits)  # a row with none drawn: its prompt's
                pos = pos + counts
            self._logits, self._cache, self._mask, self._pos = logits, cache, mask, pos
        else:
            _drop_last(self._cache)
            self._logits, self._cache = g._forward(self._last[:, None], self._mask, self._pos, self._cache)
        return True


SWAP_MODES = ("recompute", "keep")

# tokens a shared prefix must spare before it is forwarded on its own: below that, the extra
# forward's fixed cost outweighs them (benchmarks/RESULTS.md, "The sampler on the AVX512-BF16
# CPU, second pass": on SmolLM2 it pays from about 4 prompts of its chat template up)
SHARED_PREFIX_SAVES = 128


def _shared_prefix(prompts: list[tuple[int, ...]]) -> int:
    """How many leading tokens all ``prompts`` share and are forwarded once for all, each prompt
    keeping at least one token of its own (its logits come from its last); 0 where sharing them
    would not pay."""
    if len(prompts) < 2:
        return 0
    first, shortest = prompts[0], min(len(p) for p in prompts)
    n = 0
    while n < shortest - 1 and all(p[n] == first[n] for p in prompts):
        n += 1
    return n if n * (len(prompts) - 1) >= SHARED_PREFIX_SAVES else 0


def _drop_last(cache: Any) -> None:
    """Forget the cache's last position. A negative count removes that many tokens in every
    transformers version; a positive one meant "keep this many" (and still does, deprecated)."""
    cache.crop(-1)


def _layers(cache: Any) -> list[Any] | None:
    """The cache's per-layer tensors where they are plain (a ``DynamicLayer`` each: keys and
    values ``[rows, heads, length, dim]``); None for a layout that cannot be padded or cut
    (sliding windows, quantized or offloaded caches): such a batch takes no joiners."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer).__name__ != "DynamicLayer" or layer.keys is None for layer in layers):
        return None
    return list(layers)


def _pads(cache: Any) -> bool:
    return _layers(cache) is not None


_trims = _pads


def _cut_left(cache: Any, columns: int) -> None:
    for layer in _layers(cache) or ():
        layer.keys, layer.values = layer.keys[:, :, columns:], layer.values[:, :, columns:]


def _pad_left(cache: Any, columns: int) -> None:
    for layer in _layers(cache) or ():
        k, v = layer.keys, layer.values
        layer.keys = torch.cat([k.new_zeros((*k.shape[:2], columns, k.shape[3])), k], dim=2)
        layer.values = torch.cat([v.new_zeros((*v.shape[:2], columns, v.shape[3])), v], dim=2)


def _concat(cache: Any, other: Any) -> None:
    """``other``'s rows after ``cache``'s (the same length, padded first)."""
    mine, theirs = _layers(cache), _layers(other)
    assert mine is not None and theirs is not None and len(mine) == len(theirs)
    for a, b in zip(mine, theirs, strict=True):
        a.keys, a.values = torch.cat([a.keys, b.keys]), torch.cat([a.values, b.values])

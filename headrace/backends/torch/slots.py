"""The KV cache of a batch the decode step (``decode_step.DecodePlan``) decodes: per layer,
buffers with room for the rest of the generation, and which of the batch's rows each buffer row
holds.

Why the rows have an order of their own: a row that has ended rides along in the batch until
every row of its request has ended, and each row costs a decode step about 1 ms over a fixed
~30 ms (SmolLM2-135M, one CPU thread: 30 ms at 8 rows, 86 ms at 64). So a row that ends is
swapped behind the running ones (two rows copied per buffer) and the step
computes only the leading ``active`` rows, views of the buffers, without compacting them (a copy
of every buffer, which cost more than it saved: benchmarks/RESULTS.md, "A CPU with AVX512-BF16
and no AMX"). The batch's own bookkeeping (``generate.Generation``) keeps its rows in their
order; :meth:`KVSlots.settle` gives the cache back in that order when it is needed whole (a
join, a swap of weights, transformers' forward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class KVSlots:
    """Per layer, the keys and values ``[slots, kv heads, capacity, dim]`` with the first
    ``length`` columns written, and the additive mask ``[slots, capacity]`` (0 where a row
    attends, the dtype's lowest value elsewhere). Slot ``s`` holds the batch's row
    ``rows[s]`` (None: one that left the batch); the first ``active`` slots hold the running
    rows, the others rows that ended."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], mask: Tensor, length: int):
        self.keys, self.values, self.mask, self.length = keys, values, mask, length
        self.rows: list[int | None] = list(range(mask.shape[0]))
        self.active = mask.shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @staticmethod
    def of(cache: Any, attends: Tensor, room: int, index: Tensor | None = None) -> KVSlots:
        """``cache``'s plain layers (``DynamicLayer``: ``[rows, kv, length, dim]`` keys and values)
        copied into buffers with ``room`` more columns; ``attends``: ``[rows, length]``, nonzero
        where a row attends; ``index``: the cache's row for each row (a prefill's distinct prompts
        copied out to their rows in the same pass), else the cache's rows themselves."""
        keys, values = [], []
        rows, length = attends.shape
        for layer in cache.layers:
            k, v = layer.keys, layer.values
            assert k.shape[2] == length
            shape = (rows, k.shape[1], length + room, k.shape[3])
            kb, vb = k.new_empty(shape), v.new_empty(shape)
            if index is None:
                kb[:, :, :length], vb[:, :, :length] = k, v
            else:
                torch.index_select(k, 0, index, out=kb[:, :, :length])
                torch.index_select(v, 0, index, out=vb[:, :, :length])
            # the columns not yet written stay finite: masked, but their products still enter the sums
            kb[:, :, length:].zero_()
            vb[:, :, length:].zero_()
            keys.append(kb)
            values.append(vb)
        dtype = keys[0].dtype
        mask = torch.full((rows, length + room), torch.finfo(dtype).min, dtype=dtype, device=attends.device)
        mask[:, :length].masked_fill_(attends.bool(), 0.0)
        return KVSlots(keys, values, mask, length)

    def running(self) -> list[int]:
        """The batch's rows the step computes, in the order of its tokens and logits."""
        return [r for r in self.rows[: self.active] if r is not None]

    def retire(self, rows: list[int]) -> None:
        """The batch's ``rows`` (running ones) moved behind the running rows, which stay in the
        leading slots: each pair of slots swapped in every buffer, all pairs in one copy."""
        if not rows:
            return
        where = {r: s for s, r in enumerate(self.rows) if r is not None}
        leaving = sorted(where[r] for r in rows)
        if leaving[-1] >= self.active:
            raise ValueError("only running rows can be retired")
        tail = self.active - len(leaving)
        # running rows now in the tail's slots trade places with leaving rows before it
        gone = set(leaving)
        staying = [s for s in range(tail, self.active) if s not in gone]
        moving = [s for s in leaving if s < tail]
        if moving:
            to = torch.tensor(moving + staying, device=self.mask.device)
            frm = torch.tensor(staying + moving, device=self.mask.device)
            for buf in (*self.keys, *self.values, self.mask):
                buf[to] = buf[frm]
            for a, b in zip(moving, staying, strict=True):
                self.rows[a], self.rows[b] = self.rows[b], self.rows[a]
        self.active = tail

    def renumber(self, keep: list[int]) -> None:
        """The batch kept only its rows ``keep`` (none of the others running), renumbered in that
        order: the others' slots are left unused."""
        new = {old: i for i, old in enumerate(keep)}
        if any(r is not None and r not in new for r in self.rows[: self.active]):
            raise ValueError("a running row cannot leave without being retired first")
        self.rows = [None if r is None else new.get(r) for r in self.rows]

    def settle(self, cache: Any) -> None:
        """``cache``'s layers made the written columns again, one row per batch row in the batch's
        order (transformers' forward and the batch's joins and swaps work on them): views of the
        buffers while every slot holds its own row, else a copy."""
        in_order = all(r == s for s, r in enumerate(self.rows))
        order = None
        if not in_order:
            where = {r: s for s, r in enumerate(self.rows) if r is not None}
            order = torch.tensor([where[r] for r in range(len(where))], device=self.mask.device)
        for layer, k, v in zip(cache.layers, self.keys, self.values, strict=True):
            k, v = k[:, :, : self.length], v[:, :, : self.length]
            if order is not None:
                k, v = k.index_select(0, order), v.index_select(0, order)
            layer.keys, layer.values = k, v

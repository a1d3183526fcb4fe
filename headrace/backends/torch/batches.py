"""Datums into the tensors of one forward pass, and datums into passes (microbatches).

Two layouts. *Padded*: one datum a row, right-padded to the longest (padding has mask 0 and,
right of every real token, is never attended to by one). *Packed*: several datums end to end in
a row, each with its own position ids from 0; transformers' masking (``find_packed_sequence_indices``)
turns position ids that restart into a block-diagonal causal mask when no attention mask and no
cache are passed, so a datum attends to itself alone and its logprobs are the padded layout's
(to float round-off: tests/test_torch_packing.py). Packing removes the padding of batches whose
lengths differ (SFT's conversations); it is used for per-token losses only, where a row holding
several sequences changes nothing (``cross_entropy``): a per-sequence statistic (GSPO's ratio,
``sequence_mean``) reads a row as one sequence.

A third, *shared prefix* (``tree``), for datums that begin alike (a GRPO group's samples of one
prompt, DPO's chosen and rejected): each row holds one prefix once and then every datum's own
suffix, each attending to the prefix and to itself (a 4-D mask), so the prompt's activations are
computed once for the group, not once per sample. The loss still reads the padded layout: each
datum's positions gather their hidden states from the row (``gather``), the prefix's slots for
the shared positions, whose gradient autograd sums over the datums. The result is the padded
layout's to float round-off (tests/test_torch_tree.py).

Every batch carries ``spans``: where each of its datums lies, (row, start, length), so results
go back to the datum they belong to whatever the layout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from headrace.core.types import Datum

Batch = dict[str, Any]  # tensors [rows, time] by name, and "spans"


def pad(datums: Sequence[Datum], pad_id: int, device: torch.device) -> Batch:
    """One datum a row, right-padded; padding has mask 0, so it never reaches the loss."""
    return _tensors([[d] for d in datums], pad_id, device, packed=False)


def pack(datums: Sequence[Datum], pad_id: int, device: torch.device, length: int = 0) -> Batch:
    """The datums end to end in rows of ``length`` tokens (at least the longest datum's), first
    fit in decreasing length; each datum's position ids start at 0."""
    width = max([length, *(len(d.model_input) for d in datums)])
    rows: list[list[Datum]] = []
    room: list[int] = []
    order: list[int] = sorted(range(len(datums)), key=lambda i: -len(datums[i].model_input))
    placed: list[list[int]] = []
    for i in order:
        n = len(datums[i].model_input)
        row = next((r for r, free in enumerate(room) if free >= n), None)
        if row is None:
            rows.append([])
            placed.append([])
            room.append(width)
            row = len(rows) - 1
        rows[row].append(datums[i])
        placed[row].append(i)
        room[row] -= n
    batch = _tensors(rows, pad_id, device, packed=True)
    # spans in the caller's datum order
    flat = [i for row in placed for i in row]
    by_datum = dict(zip(flat, batch["spans"], strict=True))
    batch["spans"] = [by_datum[i] for i in range(len(datums))]
    return batch


def _tensors(rows: list[list[Datum]], pad_id: int, device: torch.device, packed: bool) -> Batch:
    longest = max(sum(len(d.model_input) for d in row) for row in rows)
    spans: list[tuple[int, int, int]] = []

    def tensor(field: str, fill: Any, dtype: torch.dtype) -> torch.Tensor:
        out = []
        for row in rows:
            values: list[Any] = []
            for d in row:
                values += list(getattr(d, field)) if field != "real" else [True] * len(d.model_input)
            out.append(values + [fill] * (longest - len(values)))
        return torch.tensor(out, dtype=dtype).to(device)

    positions = []
    for r, row in enumerate(rows):
        start, ids = 0, list[int]()
        for d in row:
            n = len(d.model_input)
            spans.append((r, start, n))
            ids += range(n)
            start += n
        positions.append(ids + [0] * (longest - start))  # padding: segments of its own, never attended to
    batch: Batch = {
        "input": tensor("model_input", pad_id, torch.long),
        "target": tensor("target_tokens", 0, torch.long),
        "logprobs": tensor("logprobs", 0.0, torch.float32),
        "advantages": tensor("advantages", 0.0, torch.float32),
        "mask": tensor("mask", 0.0, torch.float32),
        "real": tensor("real", False, torch.bool),
        "spans": spans,
    }
    if packed:
        batch["position_ids"] = torch.tensor(positions, dtype=torch.long).to(device)
    return batch


@dataclass
class Tree:
    """Datums (indices) that begin with the same ``shared`` tokens: one row of the tree layout."""

    members: list[int]
    shared: int

    def slots(self, datums: Sequence[Datum]) -> int:
        return self.shared + sum(len(datums[i].model_input) - self.shared for i in self.members)


def _common(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    for x, y in zip(a[:limit], b[:limit], strict=False):
        if x != y:
            break
        n += 1
    return n


def trees(datums: Sequence[Datum], max_slots: int) -> list[Tree]:
    """The datums grouped by shared prefix, each group a row of at most ``max_slots`` tokens (a
    datum over it alone). Greedy over the datums in token order, where datums that begin alike
    are neighbours: the next datum joins the current tree when that makes the tree's rows
    shorter (``k`` members keeping a prefix ``p'`` of the tree's ``p``: ``k p' > (k - 1) p``), so
    a group keeps its prompt rather than sharing only the system prompt with the next group."""
    order = sorted(range(len(datums)), key=lambda i: list(datums[i].model_input))
    out: list[Tree] = []
    for i in order:
        tokens = datums[i].model_input
        if out:
            tree = out[-1]
            first = datums[tree.members[0]].model_input
            shared = _common(first, tokens, tree.shared)
            k = len(tree.members)
            grown = Tree(tree.members + [i], shared)
            if shared > 0 and k * shared > (k - 1) * tree.shared and grown.slots(datums) <= max_slots:
                out[-1] = grown
                continue
        out.append(Tree([i], len(tokens)))
    return out


def tree(
    groups: Sequence[Tree], datums: Sequence[Datum], pad_id: int, device: torch.device, dtype: torch.dtype
) -> Batch:
    """The padded layout of the groups' datums (in the groups' order), plus ``tree``: the rows
    the body runs (``input``, ``position_ids``, an additive ``[rows, 1, width, width]`` mask in
    ``dtype``) and, per padded position, the (row, slot) its hidden state comes from."""
    flat = [datums[i] for g in groups for i in g.members]
    batch = pad(flat, pad_id, device)
    width = max(g.slots(datums) for g in groups)
    longest = batch["input"].shape[1]
    ids = torch.full((len(groups), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(groups), width), dtype=torch.long)
    allowed = torch.zeros((len(groups), width, width), dtype=torch.bool)
    row_of = torch.zeros((len(flat), longest), dtype=torch.long)
    slot_of = torch.zeros((len(flat), longest), dtype=torch.long)
    causal = torch.ones((width, width), dtype=torch.bool).tril()
    d = 0
    for r, g in enumerate(groups):
        p = g.shared
        first = datums[g.members[0]].model_input
        ids[r, :p] = torch.tensor(list(first[:p]), dtype=torch.long)
        positions[r, :p] = torch.arange(p)
        allowed[r, :p, :p] = causal[:p, :p]
        start = p
        for i in g.members:
            tokens = datums[i].model_input
            n = len(tokens) - p
            end = start + n
            ids[r, start:end] = torch.tensor(list(tokens[p:]), dtype=torch.long)
            positions[r, start:end] = torch.arange(p, p + n)
            allowed[r, start:end, :p] = True
            allowed[r, start:end, start:end] = causal[:n, :n]
            row_of[d] = r
            slot_of[d, :p] = torch.arange(p)
            slot_of[d, p : p + n] = torch.arange(start, end)
            start, d = end, d + 1
        allowed[r, start:, :] = causal[start:, :]  # padding: attends somewhere, is never read
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    batch["tree"] = {
        "input": ids.to(device),
        "position_ids": positions.to(device),
        "attention_mask": mask[:, None].to(device),
        "gather": (row_of.to(device), slot_of.to(device)),
    }
    return batch


def tree_microbatches(
    groups: Sequence[Tree], datums: Sequence[Datum], max_tokens: int, max_loss_tokens: int
) -> Iterator[list[Tree]]:
    """Trees per forward pass, the widest first: as many as fit ``max_tokens`` (rows x the
    widest row) and ``max_loss_tokens`` loss positions (a tree over either goes alone)."""
    order = sorted(groups, key=lambda g: -g.slots(datums))
    chunk: list[Tree] = []
    loss_tokens = 0
    for g in order:
        n_loss = sum(1 for i in g.members for m in datums[i].mask if m != 0)
        if chunk and ((len(chunk) + 1) * chunk[0].slots(datums) > max_tokens or loss_tokens + n_loss > max_loss_tokens):
            yield chunk
            chunk, loss_tokens = [], 0
        chunk.append(g)
        loss_tokens += n_loss
    if chunk:
        yield chunk


def rows_of(values: torch.Tensor | list[list[float]], batch: Batch) -> list[Any]:
    """Each datum's slice of a ``[rows, time]`` result, in the batch's datum order."""
    return [values[r][s : s + n] for r, s, n in batch["spans"]]


def microbatches(
    datums: Sequence[Datum], size: int, max_tokens: int, max_loss_tokens: int, packed: bool = False
) -> Iterator[list[int]]:
    """Datum indices per forward pass, longest first so each pads to similar lengths: ``size``
    datums a pass when set, else as many as fit ``max_tokens`` tokens (padded: rows x the longest;
    packed: their sum) and ``max_loss_tokens`` loss positions (a datum over either goes alone)."""
    order = sorted(range(len(datums)), key=lambda i: -len(datums[i].model_input))
    if size:
        for start in range(0, len(order), size):
            yield order[start : start + size]
        return
    chunk: list[int] = []
    loss_tokens = total = 0
    for i in order:
        n, n_loss = len(datums[i].model_input), sum(1 for m in datums[i].mask if m != 0)
        if chunk:
            cost = total + n if packed else (len(chunk) + 1) * len(datums[chunk[0]].model_input)  # chunk[0]: longest
            if cost > max_tokens or loss_tokens + n_loss > max_loss_tokens:
                yield chunk
                chunk, loss_tokens, total = [], 0, 0
        chunk.append(i)
        loss_tokens += n_loss
        total += n
    if chunk:
        yield chunk

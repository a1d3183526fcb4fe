"""Data parallelism's arithmetic: datums cut into shards balanced by loss tokens, the shards'
metrics merged back into one call's, and the gradient all-reduce the torch trainer calls (its
``gradient_sum`` hook) before each update."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any

from headrace.core.types import Datum, LossSpec


def shard_bounds(datums: Sequence[Datum], k: int) -> list[int]:
    """K+1 indices cutting ``datums`` into K contiguous shards of about equal loss tokens (equal
    counts when there are none); a shard may be empty."""
    weights = [sum(1 for m in d.mask if m != 0) for d in datums]
    if not any(weights):
        weights = [1] * len(datums)
    prefix = [0, *itertools.accumulate(weights)]
    bounds = [0]
    for j in range(1, k):
        target = prefix[-1] * j / k
        end = bisect.bisect_left(prefix, target)
        if end > 0 and target - prefix[end - 1] < prefix[min(end, len(prefix) - 1)] - target:
            end -= 1
        bounds.append(min(max(end, bounds[-1]), len(datums)))
    return [*bounds, len(datums)]


def loss_divisor(datums: Sequence[Datum], loss: LossSpec) -> float:
    """What these datums add to the step's divisor, as the torch trainer counts it (its
    ``losses.token_weights``): ``optim/loss`` is a mean over it, so shards merge weighted by it."""
    aggregation = str(loss.config.get("aggregation", "token_mean"))
    if aggregation == "token_mean":
        return float(sum(sum(d.mask) for d in datums))
    sequences = float(sum(1 for d in datums if any(m != 0 for m in d.mask)))
    if aggregation == "dr_grpo":
        return sequences * float(loss.config.get("normalizer", 0.0) or 0.0)
    return sequences


TOKENS = "optim/loss_tokens:sum"


def merge_metrics(shards: list[dict[str, float]], divisors: list[float]) -> dict[str, float]:
    """One call's metrics from its shards': ``:sum`` keys summed, ``:max``/``:min`` the extreme,
    ``optim/loss`` weighted by each shard's divisor, every other a per-token mean weighted by the
    shard's loss tokens."""
    tokens = [m.get(TOKENS, 0.0) for m in shards]
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in shards for k in m):
        rows = [(m[key], t, d) for m, t, d in zip(shards, tokens, divisors, strict=True) if key in m]
        values = [v for v, _, _ in rows]
        if key.endswith(":sum"):
            out[key] = sum(values)
        elif key.endswith(":max"):
            out[key] = max(values)
        elif key.endswith(":min"):
            out[key] = min(values)
        else:
            weights = [d if key == "optim/loss" else t for _, t, d in rows]
            total = sum(weights)
            out[key] = sum(v * w for v, w in zip(values, weights, strict=True)) / total if total > 0 else 0.0
    return out


def gradient_sum(grads: list[Any], tokens: float, norm: float, finite: bool) -> tuple[float, float, bool]:
    """The trainer's hook with world > 1: every rank's gradients summed in place, one flat buffer
    per dtype (one all-reduce, not one per tensor), and the step's totals. Runs on the device
    thread; gloo reduces CPU tensors, so a GPU's gradients go through the host."""
    import torch
    import torch.distributed as dist

    by_dtype: dict[Any, list[Any]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group]).to("cpu")
        dist.all_reduce(flat)
        offset = 0
        for g in group:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    totals = torch.tensor([tokens, norm, 0.0 if finite else 1.0], dtype=torch.float64)
    dist.all_reduce(totals)
    return float(totals[0]), float(totals[1]), bool(totals[2] == 0)

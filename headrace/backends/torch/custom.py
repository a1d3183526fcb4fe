"""Post-training's two calls beside the RL step (``ComputesCustomLoss``): a forward that only
scores (held-out losses, DPO's reference and evaluations), and a forward-backward of a loss the
caller computes from each datum's target logprobs (DPO's). Both run on the device thread."""

from __future__ import annotations

from typing import Any

import torch

from headrace.core.types import Datum

from .batches import rows_of
from .scoring import Scorer


def score(scorer: Scorer, datums: list[Datum], reference: bool) -> list[list[float]]:
    """Each datum's target logprobs under the current weights (or the frozen reference), no gradient."""
    out: list[list[float]] = [[] for _ in datums]
    for idx, batch in scorer.batches(datums):
        with torch.no_grad():
            if reference:
                # every real position is scored: the reference's forward reads the mask for that
                logp = scorer.reference_logprobs({**batch, "mask": batch["real"].to(torch.float32)})
            else:
                logp = scorer.target_logprobs({**batch, "mask": torch.zeros_like(batch["mask"])})
        for i, row in zip(idx, rows_of(logp.to("cpu").tolist(), batch), strict=True):
            out[i] = row
    return out


def forward_backward_custom(
    scorer: Scorer, datums: list[Datum], loss_fn: Any
) -> tuple[float, int, list[list[float]], dict[str, Any]]:
    """``loss_fn(datums, logprobs)`` over each datum's target logprobs (with their gradient at
    its mask != 0 positions), back-propagated as it stands: (the loss, the loss tokens, the
    logprobs, the loss's metrics). Every microbatch's graph is held until the loss is known."""
    rows: list[torch.Tensor | None] = [None] * len(datums)
    for idx, batch in scorer.batches(datums):
        logp = scorer.target_logprobs(batch)
        for i, row in zip(idx, rows_of(logp, batch), strict=True):
            rows[i] = row
    logprobs = [r if r is not None else torch.zeros(0) for r in rows]
    total, metrics = loss_fn(datums, logprobs)
    if total.requires_grad:
        total.backward()
    tokens = sum(sum(1 for m in d.mask if m != 0) for d in datums)
    return float(total.detach()), tokens, [r.detach().to("cpu").tolist() for r in logprobs], metrics

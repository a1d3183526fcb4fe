"""The draw of each decode step: temperature, top-k and top-p per row, and an inverse-CDF draw
from each request's own generator, so a seeded request samples the same tokens whatever it was
batched with (``generate.Generation`` calls it once per step)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor, nn


class Shaped(Protocol):
    """What the draw reads of a row (``generate.Row``)."""

    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator


class Shaping:
    """Temperature, top-k, top-p per row, and inverse-CDF draws from each request's generator,
    so a seeded request samples the same tokens whatever it was batched with."""

    def __init__(self, rows: Sequence[Shaped], dev: torch.device):
        self.dev = dev
        temps = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=dev)
        self.greedy = temps <= 0
        self.temps = torch.where(self.greedy, torch.ones_like(temps), temps)
        self.any_greedy = any(r.temperature <= 0 for r in rows)
        self.all_unit = all(r.temperature == 1.0 or r.temperature <= 0 for r in rows)  # no division
        self.top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=dev)
        self.top_k = torch.tensor([r.top_k if r.top_k > 0 else 1 << 30 for r in rows], device=dev)
        self.filtered = any(r.top_p < 1.0 or r.top_k > 0 for r in rows)
        self.all_greedy = bool(self.greedy.all())
        self.runs: list[tuple[torch.Generator, int]] = []  # (generator, number of adjacent rows)
        for r in rows:
            if self.runs and self.runs[-1][0] is r.generator:
                self.runs[-1] = (r.generator, self.runs[-1][1] + 1)
            else:
                self.runs.append((r.generator, 1))

    def _uniforms(self) -> Tensor:
        # every row draws every step, even once finished: a request's stream never depends on timing
        parts = [torch.rand(n, generator=g, device=g.device).to(self.dev) for g, n in self.runs]
        return torch.cat(parts)

    def draw(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """A token per row from ``logits``, and its logprob under the model's plain distribution
        (temperature 1, no filtering: what the learner computes)."""
        plain = logits.softmax(-1)
        if self.all_greedy:
            choice = logits.argmax(-1)
            return choice, _logprobs(logits, plain, choice)
        u = self._uniforms()
        if not self.filtered and self.all_unit:
            probs = plain
        else:
            scaled = logits if self.all_unit else logits / self.temps[:, None]
            if self.filtered:
                scaled, order = scaled.sort(dim=-1, descending=True)
            probs = scaled.softmax(-1)
            if self.filtered:
                rank = torch.arange(probs.shape[-1], device=self.dev)[None, :]
                before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
                keep = (rank < self.top_k[:, None]) & ((before < self.top_p[:, None]) | (rank == 0))
                probs = probs * keep
        choice = _inverse_cdf(probs, u)
        if self.filtered:
            choice = order.gather(-1, choice[:, None]).squeeze(-1)
        if self.any_greedy:
            choice = torch.where(self.greedy, logits.argmax(-1), choice)
        return choice, _logprobs(logits, plain, choice)


def _logprobs(logits: Tensor, plain: Tensor, tokens: Tensor) -> Tensor:
    """``log_softmax(logits)`` at ``tokens``, up to float round-off, as the log of the plain
    softmax the draw already made: a second ``[rows, vocab]`` pass for the log-softmax cost more
    than the draw (SmolLM2 at 64 rows: 3.9 against 1.4 ms). A probability that underflowed to 0
    (a token a shaped distribution drew that the plain one gives under 1e-38) takes the
    log-softmax itself."""
    picked = plain.gather(-1, tokens[:, None]).squeeze(-1)
    out = picked.log()
    lost = picked == 0
    if bool(lost.any()):
        exact = logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
        out = torch.where(lost, exact, out)
    return out


BLOCK = 1024  # tokens per block of the two-level inverse CDF


def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Per row, the first token whose cumulative probability exceeds ``u`` times the row's total:
    the blocks' sums first, then the running sum inside the one block the draw falls in (a
    cumulative sum over a 49k vocabulary per row costs more than the rest of the draw). Never a
    zero-probability token: the search takes the first sum strictly above the target, and the
    round-off guards fall back to the last block and token that carry mass."""
    rows, vocab = probs.shape
    if vocab <= 2 * BLOCK:  # a small vocabulary (the tiny model's): one running sum is cheaper
        cdf = probs.cumsum(-1)
        return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp(max=vocab - 1)
    blocks = -(-vocab // BLOCK)
    if blocks * BLOCK != vocab:
        probs = nn.functional.pad(probs, (0, blocks * BLOCK - vocab))
    tiled = probs.view(rows, blocks, BLOCK)
    mass = tiled.sum(-1)  # [rows, blocks]
    cdf = mass.cumsum(-1)
    target = (u * cdf[:, -1])[:, None]
    last_block = blocks - 1 - (mass > 0).flip(-1).int().argmax(-1, keepdim=True)
    block = torch.searchsorted(cdf, target, right=True).clamp(max=blocks - 1).minimum(last_block)
    inner = tiled.gather(1, block[:, :, None].expand(rows, 1, BLOCK)).squeeze(1)  # [rows, BLOCK]
    below = cdf.gather(1, block) - mass.gather(1, block)  # the mass of the blocks before it
    inner_cdf = inner.cumsum(-1) + below
    last_token = BLOCK - 1 - (inner > 0).flip(-1).int().argmax(-1, keepdim=True)
    token = torch.searchsorted(inner_cdf, target, right=True).minimum(last_token)
    return (block * BLOCK + token).squeeze(-1)

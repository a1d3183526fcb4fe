"""Batched sampling with a KV cache: one prefill of the left-padded prompts, then one forward
per new token for the whole batch. Runs on the device thread.

Shared prefixes: a group's rows share one prompt, so each distinct prompt is prefilled once and
its KV cache (and last logits) copied to its rows before decoding: 8 prompts of 43 tokens x 8
rows x 16 tokens on SmolLM2-135M (one CPU thread) sample in 6.6 s instead of 13.2 s.

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

from .flops import ModelShape, PerfMeter, causal_pairs


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


class Generator:
    def __init__(self, model: nn.Module, pad_token_id: int, device: torch.device, meter: PerfMeter | None = None):
        self.model = model
        self.pad_token_id = pad_token_id
        self.device = device
        self.meter = meter  # FLOPs per forward, as prefill or decode
        self._shape = ModelShape.of(model) if meter is not None else None
        params = inspect.signature(model.forward).parameters
        # transformers 5.x renamed past_key_values to cache
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def _forward(self, ids: Tensor, mask: Tensor, pos: Tensor, cache):
        if self.meter is not None:
            assert self._shape is not None
            rows, new = ids.shape
            past = mask.shape[1] - new
            pairs = rows * new * past + causal_pairs(rows, new)
            self.meter.add("prefill" if new > 1 else "decode", flops=self._shape.forward(rows * new, pairs, rows))
        kwargs = {self._cache_kw: cache}
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1, **kwargs
        )
        next_cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
        return out.logits[:, -1, :].float(), next_cache

    def _prefill(self, rows: list[Row]) -> tuple[Tensor, Any, Tensor, Tensor]:
        """Logits after each row's prompt, the cache, the attention mask and the last positions,
        computed once per distinct prompt and then indexed out to the rows."""
        dev = self.device
        distinct: dict[tuple[int, ...], int] = {}
        of_row = [distinct.setdefault(tuple(r.prompt), len(distinct)) for r in rows]
        prompts = list(distinct)
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, longest - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits, cache = self._forward(ids, mask, pos, None)
        if len(prompts) < len(rows):
            index = torch.tensor(of_row, dtype=torch.long, device=dev)
            cache.batch_select_indices(index)  # a copy per row: rows then decode independently
            logits, mask, pos = logits[index], mask[index], pos[index]
        return logits, cache, mask, pos[:, -1:]

    @torch.no_grad()
    def generate(self, rows: list[Row]) -> list[RowResult]:
        generation = Generation(self, rows)
        generation.advance(None)
        return generation.results()


class Generation:
    """One batch of rows sampled a few decode steps at a time (``advance``), so the device can run
    other work between steps, and new weights can be taken between two steps (``reweigh``): the
    tokens drawn after it come from the new weights, and each token records the version that drew
    it. ``Generator.generate`` runs one to the end in a single call.

    A weight swap must also redo the logits of the next token, which the old weights computed
    from the last token forwarded. ``reweigh`` either recomputes the whole KV cache under the new
    weights (``"recompute"``: the rows' prompts prefilled once each again, then every token
    sampled so far in one pass), so a post-swap token is exactly what the new weights would
    sample from scratch; or keeps the cache as PipelineRL does (``"keep"``: only the last token
    is forwarded again), so post-swap tokens attend to keys and values the old weights made
    (benchmarks/RESULTS.md, "In-flight updates", measures both)."""

    def __init__(self, generator: Generator, rows: list[Row], version: int = -1):
        self.g, self.rows, self.version = generator, rows, version
        dev, B = generator.device, len(rows)
        self._shaping = _Shaping(rows, dev)
        self._stops = _StopTable(rows, dev)
        self._max_tokens = torch.tensor([r.max_tokens for r in rows], device=dev)
        self._limit = int(self._max_tokens.max())
        self._finished = torch.zeros(B, dtype=torch.bool, device=dev)
        self._stopped = torch.zeros(B, dtype=torch.bool, device=dev)
        self._lengths = torch.zeros(B, dtype=torch.long, device=dev)
        self._tokens_S: list[Tensor] = []
        self._logprobs_S: list[Tensor] = []
        self._versions_S: list[int] = []
        self._logits: Tensor | None = None  # the next token's logits; None until the prefill
        self._cache: Any = None
        self._mask = self._pos = torch.empty(0)
        self.step = 0  # tokens drawn so far (per row, padding included)
        self.done = self._limit <= 0

    @torch.no_grad()
    def advance(self, steps: int | None) -> bool:
        """Draw up to ``steps`` more tokens per row (None: to the end); True once every row ended."""
        g, dev, B = self.g, self.g.device, len(self.rows)
        if self._logits is None and not self.done:
            self._logits, self._cache, self._mask, self._pos = g._prefill(self.rows)
        taken = 0
        while not self.done and (steps is None or taken < steps):
            assert self._logits is not None
            token = self._shaping.draw(self._logits)
            token = torch.where(self._finished, torch.full_like(token, g.pad_token_id), token)
            self._logprobs_S.append(self._logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1))
            self._tokens_S.append(token)
            self._versions_S.append(self.version)
            step, taken = self.step, taken + 1
            self.step += 1
            is_stop = self._stops.check(token) & ~self._finished
            ends = ~self._finished & (is_stop | (self._max_tokens <= step + 1))
            self._lengths = torch.where(ends, step + 1, self._lengths)
            self._stopped |= is_stop
            self._finished |= ends
            # one host sync per token: the batch ends with its longest row
            if bool(self._finished.all()) or self.step >= self._limit:
                self.done = True
                break
            self._mask = torch.cat([self._mask, torch.ones((B, 1), dtype=self._mask.dtype, device=dev)], dim=1)
            self._pos = self._pos + 1
            self._logits, self._cache = g._forward(token[:, None], self._mask, self._pos, self._cache)
        return self.done

    @torch.no_grad()
    def reweigh(self, version: int, mode: str) -> bool:
        """The model's weights were just changed to ``version``: redo what the next token is drawn
        from (``mode``: ``"recompute"`` the KV cache, or ``"keep"`` it). False: nothing to redo
        (not prefilled yet, the new weights will; or over)."""
        if mode not in SWAP_MODES:
            raise ValueError(f"unknown swap mode {mode!r}; use one of {', '.join(SWAP_MODES)}")
        self.version = version
        if self._logits is None or self.done:
            return False
        g, dev = self.g, self.g.device
        if mode == "recompute":
            logits, cache, mask, pos = g._prefill(self.rows)
            if self._tokens_S:
                drawn = torch.stack(self._tokens_S, 1)  # finished rows' padding too: the same layout
                n = drawn.shape[1]
                mask = torch.cat([mask, torch.ones((len(self.rows), n), dtype=mask.dtype, device=dev)], dim=1)
                positions = pos + torch.arange(1, n + 1, device=dev)[None, :]
                logits, cache = g._forward(drawn, mask, positions, cache)
                pos = positions[:, -1:]
            self._logits, self._cache, self._mask, self._pos = logits, cache, mask, pos
        else:
            if self._tokens_S:
                last = self._tokens_S[-1]
            else:
                last = torch.tensor([r.prompt[-1] for r in self.rows], dtype=torch.long, device=dev)
            _drop_last(self._cache)
            self._logits, self._cache = g._forward(last[:, None], self._mask, self._pos, self._cache)
        return True

    def finished(self) -> list[bool]:
        """Which rows have ended (drawn a stop token or reached their max_tokens)."""
        return self._finished.tolist()

    def results(self, rows: range | None = None) -> list[RowResult]:
        """Every row's tokens (or those of ``rows``, ended ones, before the batch is over)."""
        rows = range(len(self.rows)) if rows is None else rows
        if not self._tokens_S:
            return [RowResult([], [], StopReason.LENGTH, ()) for _ in rows]
        index = torch.tensor(list(rows), dtype=torch.long, device=self.g.device)
        tokens = torch.stack(self._tokens_S, 1)[index].tolist()
        logprobs = torch.stack(self._logprobs_S, 1)[index].tolist()
        lengths_l, stopped_l = self._lengths[index].tolist(), self._stopped[index].tolist()
        return [
            RowResult(
                tokens[i][:n],
                logprobs[i][:n],
                StopReason.STOP if stopped_l[i] else StopReason.LENGTH,
                tuple(self._versions_S[:n]),
            )
            for i, n in enumerate(lengths_l)
        ]


SWAP_MODES = ("recompute", "keep")


def _drop_last(cache: Any) -> None:
    """Forget the cache's last position. A negative count removes that many tokens in every
    transformers version; a positive one meant "keep this many" (and still does, deprecated)."""
    cache.crop(-1)


class _StopTable:
    """Which row stops on which token, vectorised over the union of every row's stop ids."""

    def __init__(self, rows: list[Row], dev: torch.device):
        union = sorted(set().union(*(r.stops for r in rows)))
        self.ids = torch.tensor(union, dtype=torch.long, device=dev)
        self.member = torch.tensor([[s in r.stops for s in union] for r in rows], dtype=torch.bool, device=dev)

    def check(self, token: Tensor) -> Tensor:
        if self.ids.numel() == 0:
            return torch.zeros_like(token, dtype=torch.bool)
        return ((token[:, None] == self.ids[None, :]) & self.member).any(-1)


class _Shaping:
    """Temperature, top-k, top-p per row, and inverse-CDF draws from each request's generator,
    so a seeded request samples the same tokens whatever it was batched with."""

    def __init__(self, rows: list[Row], dev: torch.device):
        self.dev = dev
        temps = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=dev)
        self.greedy = temps <= 0
        self.temps = torch.where(self.greedy, torch.ones_like(temps), temps)
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

    def draw(self, logits: Tensor) -> Tensor:
        argmax = logits.argmax(-1)
        if self.all_greedy:
            return argmax
        u = self._uniforms()
        scaled = logits / self.temps[:, None]
        if self.filtered:
            scaled, order = scaled.sort(dim=-1, descending=True)
        probs = scaled.softmax(-1)
        if self.filtered:
            rank = torch.arange(probs.shape[-1], device=self.dev)[None, :]
            before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
            keep = (rank < self.top_k[:, None]) & ((before < self.top_p[:, None]) | (rank == 0))
            probs = probs * keep
        cdf = probs.cumsum(-1)
        # right=True never lands on a zero-probability token; the clamp guards float round-off
        choice = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
        choice = choice.clamp(max=probs.shape[-1] - 1)
        if self.filtered:
            choice = order.gather(-1, choice[:, None]).squeeze(-1)
        return torch.where(self.greedy, argmax, choice)

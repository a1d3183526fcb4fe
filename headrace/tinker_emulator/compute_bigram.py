"""``BigramCompute``: the emulator's numpy model, no torch, milliseconds per call (``--compute
bigram``), for protocol and fault tests. What every compute follows (losses, sampling, prompt
logprobs) is in ``compute.py``.

A bigram model (the next token depends on the previous one only) over ``vocab_size`` token ids
(``--vocab-size``, default 65,536), so a client whose tokenizer is not headrace's runs against
it unchanged. The logits after token ``p`` are ``b + A[p] @ B``: a bias over the vocabulary
(the base model) plus a low-rank adapter (``A``: V x r, ``B``: r x V, r = the LoRA rank asked
for, at most 32), initialised as LoRA is (``B`` = 0, so a new model samples as the base).
Why low rank rather than the dense V x V table it replaced (34 GB at 65,536 ids) or a hashed
table: memory is O(V r) (about 67 MB for weights, gradient and Adam moments at rank 32), and
the gradients stay exact, since a softmax over the whole vocabulary is what every position
normalises over anyway; a hashed table would make ids collide, so two tokens would share
weights and the logprobs would not be a proper model's. Work is O(V r) per distinct previous token, chunked so
no temporary holds more than 2^22 floats; since the logits depend on the previous token alone,
they are computed once per distinct previous token of a batch, not once per position.

The base model puts its mass on the ids of headrace's character tokenizer (its first 56 ids get
logit 0, every other id -30): headrace's own ``tiny`` runs, which decode with that tokenizer,
read its samples as text, while any id below ``vocab_size`` is accepted in prompts and training
data, has a real logprob and gets its gradient. Weights are immutable arrays (each optim step
makes new ones), so samplers and checkpoints share them instead of copying. Text, for stop
strings, is the character tokenizer's decoding: an id outside its 56 decodes to nothing.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from headrace.tinker_emulator.compute import (
    PromptLogprobs,
    Sampler,
    SampleSpec,
    Sequence3,
    Trainer,
    check_token_ids,
    empty_topk,
    loss_and_grad,
)

DEFAULT_VOCAB = 65_536
MAX_BIGRAM_RANK = 32
OFF_CHAR_LOGIT = -30.0  # the base model's logit for an id outside the character tokenizer's
_CHUNK_FLOATS = 1 << 22  # the largest temporary a bigram call makes, in floats (16 MB)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


class _BigramWeights:
    """``b`` [V], and optionally the adapter ``A`` [V, r], ``B`` [r, V]; never written to."""

    def __init__(self, params: dict[str, np.ndarray]):
        self.b, self.A, self.B = params["b"], params.get("A"), params.get("B")
        self.vocab = len(self.b)
        self.chunk = max(1, _CHUNK_FLOATS // self.vocab)  # rows of logits per temporary

    def arrays(self) -> list[np.ndarray]:
        return [a for a in (self.b, self.A, self.B) if a is not None]

    def rows(self, prev: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """The logits after each token of ``prev``, which depend on that token alone: computed once
        per distinct token, a chunk of them at a time. Yields (the distinct tokens [U], their
        logits [U, V] float32, their log-normalisers [U], and [where, row]: the positions of
        ``prev`` holding them and, for each, its row in the logits)."""
        uniq, inverse = np.unique(prev, return_inverse=True)
        for start in range(0, len(uniq), self.chunk):
            tokens = uniq[start : start + self.chunk]
            if self.A is None or self.B is None:
                logits = np.repeat(self.b[None, :], len(tokens), axis=0)
            else:
                logits = self.A[tokens] @ self.B
                logits += self.b
            top = logits.max(axis=1)
            logz = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
            where = np.flatnonzero((inverse >= start) & (inverse < start + len(tokens)))
            yield tokens, logits, logz, np.stack([where, inverse[where] - start])


def _draw(logits: np.ndarray, spec: SampleSpec, u: float) -> int:
    """One token from one row of logits, shaped by temperature, top-k and top-p (as the torch
    sampler: top-k first, then the smallest set of the most likely tokens holding top_p), by
    inverting the CDF at the uniform draw ``u``."""
    if spec.temperature <= 0:
        return int(np.argmax(logits))
    scaled = logits / np.float32(spec.temperature)
    p = np.exp(scaled - scaled.max())
    vocab = len(p)
    ids: np.ndarray | None = None  # the candidates, or None for every id
    if 0 < spec.top_k < vocab:
        ids = np.argpartition(-p, spec.top_k - 1)[: spec.top_k]
    if spec.top_p < 1.0:
        cand = p if ids is None else p[ids]
        goal = spec.top_p * float(cand.sum(dtype=np.float64))
        few = min(len(cand), 256)  # the nucleus is usually small: sort only the top few if they hold it
        top = np.argpartition(-cand, few - 1)[:few] if few < len(cand) else np.arange(len(cand))
        if float(cand[top].sum(dtype=np.float64)) < goal:
            top = np.arange(len(cand))
        order = top[np.argsort(-cand[top], kind="stable")]
        before = np.cumsum(cand[order], dtype=np.float64) - cand[order]  # mass of the strictly more likely ones
        order = order[(before < goal) | (np.arange(len(order)) == 0)]
        ids = order if ids is None else ids[order]
    cdf = np.cumsum(p if ids is None else p[ids], dtype=np.float64)
    j = _invert(cdf, u)
    return j if ids is None else int(ids[j])


def _invert(cdf: np.ndarray, u: float) -> int:
    # side="right" never lands on a zero-probability token; the min guards float round-off
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(cdf) - 1)


class _BigramSampler:
    def __init__(self, weights: _BigramWeights, compute: BigramCompute):
        self.weights, self.compute = weights, compute
        self.vocab_size = weights.vocab

    def decode(self, tokens: Sequence[int]) -> str:
        return self.compute.tokenizer.decode(tokens)

    async def sample(self, prompt: list[int], n: int, spec: SampleSpec) -> list[Sequence3]:
        check_token_ids("the prompt", prompt, self.vocab_size)
        # on a thread, as the torch compute is: a long sample must not hold back the clock and
        # the HTTP server (inline, ops waited 0.6-0.9 s past their cycle boundary)
        return await asyncio.to_thread(self._sample, prompt, n, spec)

    def _sample(self, prompt: list[int], n: int, spec: SampleSpec) -> list[Sequence3]:
        rng = np.random.default_rng(spec.seed)
        stops = {self.compute.eos} if spec.stop_tokens is None else set(spec.stop_tokens)
        plain = spec.temperature == 1.0 and not 0 < spec.top_k < self.vocab_size and spec.top_p >= 1.0
        prev = np.full(n, prompt[-1] if prompt else 0, dtype=np.int64)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        reasons = ["length"] * n
        alive = np.arange(n)
        for _ in range(spec.max_tokens):
            if not len(alive):
                break
            draws = rng.random(len(alive))  # one per row and step, so a seed's samples never depend on batching
            for _tokens, logits, logz, (where, row) in self.weights.rows(prev[alive]):
                cdf = np.cumsum(np.exp(logits - logz[:, None]), axis=1, dtype=np.float64) if plain else None
                for w, r in zip(where.tolist(), row.tolist(), strict=True):
                    tok = _invert(cdf[r], draws[w]) if cdf is not None else _draw(logits[r], spec, draws[w])
                    i = int(alive[w])
                    tokens[i].append(tok)
                    logprobs[i].append(float(logits[r, tok] - logz[r]))
                    prev[i] = tok
                    if tok in stops:
                        reasons[i] = "stop"
            alive = np.array([i for i in alive.tolist() if reasons[i] == "length"], dtype=np.int64)
        return list(zip(tokens, logprobs, reasons, strict=True))

    async def prompt_logprobs(self, prompt: list[int], topk: int) -> PromptLogprobs:
        check_token_ids("the prompt", prompt, self.vocab_size)
        return await asyncio.to_thread(self._prompt_logprobs, prompt, topk)

    def _prompt_logprobs(self, prompt: list[int], topk: int) -> PromptLogprobs:
        T, k = len(prompt), min(topk, self.vocab_size)
        ids = np.asarray(prompt, dtype=np.int64)
        out = np.full(T, np.nan, dtype=np.float32)
        top_ids, top_lps = empty_topk(T, k) if k else (None, None)
        for _tokens, logits, logz, (where, row) in self.weights.rows(ids[:-1]):
            out[where + 1] = logits[row, ids[where + 1]] - logz[row]
            if top_ids is not None and top_lps is not None:
                part = np.argpartition(-logits, k - 1, axis=1)[:, :k] if k < self.vocab_size else None
                part = np.argsort(-logits, axis=1) if part is None else part
                vals = np.take_along_axis(logits, part, axis=1)
                order = np.argsort(-vals, axis=1, kind="stable")
                top_ids[where + 1] = np.take_along_axis(part, order, axis=1)[row]
                top_lps[where + 1] = (np.take_along_axis(vals, order, axis=1) - logz[:, None])[row]
        return PromptLogprobs(out, top_ids, top_lps)


class _BigramTrainer:
    def __init__(self, compute: BigramCompute, rank: int, seed: int | None):
        self._compute = compute
        rng = np.random.default_rng(seed)
        V, r = compute.vocab, min(max(int(rank), 1), MAX_BIGRAM_RANK)
        a = (rng.standard_normal((V, r), dtype=np.float32) / np.float32(math.sqrt(r))).astype(np.float32)
        self.params: dict[str, np.ndarray] = {
            "b": compute.prior,
            "A": _readonly(a),
            "B": _readonly(np.zeros((r, V), dtype=np.float32)),
        }
        self.m = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.grad = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.t = 0

    async def forward_backward(self, data, loss_fn, config, forward_only):
        # a model's training ops run one at a time (the clock awaits each), so the thread never
        # races another op on this trainer's gradients
        return await asyncio.to_thread(self._forward_backward, data, loss_fn, config, forward_only)

    def _forward_backward(self, data, loss_fn, config, forward_only):
        w = _BigramWeights(self.params)
        ctx_D, tgt_D = [], []
        for d in data:
            ctx = np.asarray(d.tokens, dtype=np.int64)
            tgt = d.inputs["target_tokens"].astype(np.int64)
            if len(tgt) != len(ctx):
                raise ValueError(f"target_tokens has {len(tgt)} entries for {len(ctx)} input tokens")
            check_token_ids("a datum's model_input", ctx, w.vocab)
            check_token_ids("a datum's target_tokens", tgt, w.vocab)
            ctx_D.append(ctx)
            tgt_D.append(tgt)
        ctx_all = np.concatenate(ctx_D) if ctx_D else np.zeros(0, dtype=np.int64)
        tgt_all = np.concatenate(tgt_D) if tgt_D else np.zeros(0, dtype=np.int64)
        logp = np.empty(len(ctx_all), dtype=np.float64)
        # the logits are kept for the backward when they fit in one chunk, else computed again
        one_chunk = len(np.unique(ctx_all)) <= w.chunk
        kept = list(w.rows(ctx_all)) if one_chunk else []
        for _tokens, logits, logz, (where, row) in kept or w.rows(ctx_all):
            logp[where] = logits[row, tgt_all[where]] - logz[row]
        bounds = np.cumsum([0, *map(len, ctx_D)])
        logprobs_D, dlogp, total = [], np.zeros_like(logp), 0.0
        for d, lo, hi in zip(data, bounds[:-1], bounds[1:], strict=True):
            loss, dlogp[lo:hi] = loss_and_grad(loss_fn, config, logp[lo:hi], d.inputs)
            total += loss
            logprobs_D.append(logp[lo:hi].astype(np.float32).tolist())
        if forward_only:
            return logprobs_D, {"loss:sum": total}
        for tokens, logits, logz, (where, row) in kept or w.rows(ctx_all):
            # dLoss/dlogits of a previous token u: the sum over the positions it precedes of
            # dlogp_t * (onehot(target_t) - softmax(logits_u))
            g = np.exp(logits - logz[:, None])
            g *= -np.bincount(row, weights=dlogp[where], minlength=len(tokens)).astype(np.float32)[:, None]
            np.add.at(g, (row, tgt_all[where]), dlogp[where].astype(np.float32))
            self.grad["b"] += g.sum(axis=0)
            if w.A is not None and w.B is not None:
                self.grad["B"] += w.A[tokens].T @ g
                self.grad["A"][tokens] += g @ w.B.T  # distinct tokens: no two rows collide
        return logprobs_D, {"loss:sum": total}

    async def optim_step(self, adam):
        return await asyncio.to_thread(self._optim_step, adam)

    def _optim_step(self, adam):
        lr, b1, b2 = adam.get("learning_rate", 1e-4), adam.get("beta1", 0.9), adam.get("beta2", 0.95)
        eps, wd, clip = adam.get("eps", 1e-12), adam.get("weight_decay", 0.0), adam.get("grad_clip_norm", 0.0)
        norm = math.sqrt(sum(float(np.square(g, dtype=np.float64).sum()) for g in self.grad.values()))
        scale = clip / norm if clip and norm > clip else 1.0
        self.t += 1
        params, m, v = {}, {}, {}
        for name, w in self.params.items():
            g = self.grad[name] * np.float32(scale)
            m[name] = _readonly((b1 * self.m[name] + (1 - b1) * g).astype(np.float32))
            v[name] = _readonly((b2 * self.v[name] + (1 - b2) * g * g).astype(np.float32))
            mhat, vhat = m[name] / (1 - b1**self.t), v[name] / (1 - b2**self.t)
            params[name] = _readonly((w * (1 - lr * wd) - lr * mhat / (np.sqrt(vhat) + eps)).astype(np.float32))
            self.grad[name].fill(0.0)
        self.params, self.m, self.v = params, m, v
        return {"grad_norm:mean": norm}

    async def poison(self):
        self.grad["b"][:] = np.nan

    async def save(self):
        return {"params": dict(self.params), "m": dict(self.m), "v": dict(self.v), "t": self.t}

    async def load(self, blob, optimizer):
        self.params = dict(blob["params"])
        if optimizer:
            self.m, self.v, self.t = dict(blob["m"]), dict(blob["v"]), blob["t"]
        else:
            self.m = {k: np.zeros_like(v) for k, v in self.params.items()}
            self.v = {k: np.zeros_like(v) for k, v in self.params.items()}
            self.t = 0
        self.grad = {k: np.zeros_like(v) for k, v in self.params.items()}

    async def sampler(self):
        return _BigramSampler(_BigramWeights(dict(self.params)), self._compute)

    async def close(self):
        pass


class BigramCompute:
    """The bigram model of the module docstring, served as ``tiny``, over ``vocab_size`` ids."""

    def __init__(self, vocab_size: int = DEFAULT_VOCAB) -> None:
        from headrace.tokenizers.char import CharTokenizer

        self.tokenizer = CharTokenizer()
        if vocab_size < self.tokenizer.vocab_size:
            raise ValueError(
                f"the bigram compute needs a vocabulary of at least {self.tokenizer.vocab_size} ids (the character "
                f"tokenizer's), not {vocab_size}"
            )
        self.vocab, self.eos = vocab_size, self.tokenizer.eos_token_id
        prior = np.full(vocab_size, OFF_CHAR_LOGIT, dtype=np.float32)
        prior[: self.tokenizer.vocab_size] = 0.0
        self.prior = _readonly(prior)
        self.models = ["tiny"]
        self._base: _BigramSampler | None = None

    def vocab_size(self, model: str) -> int:
        return self.vocab

    def max_context(self, model: str) -> int | None:
        return None  # a bigram has no context window

    async def create(self, base_model: str, lora: dict[str, Any]) -> Trainer:
        return _BigramTrainer(self, int(lora.get("rank") or 1), lora.get("seed"))

    async def base_sampler(self, base_model: str) -> Sampler:
        if self._base is None:
            self._base = _BigramSampler(_BigramWeights({"b": self.prior}), self)
        return self._base

    async def close(self) -> None:
        pass

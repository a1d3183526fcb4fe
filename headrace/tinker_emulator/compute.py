"""What the emulator needs from a model: the seam between the Tinker wire and the real work.

``Compute`` makes trainers (one per Tinker training client) and base-model samplers. Two
implementations: ``TorchCompute`` (``compute_torch.py``: headrace's ``torch`` backend with the
embedded tiny Llama; training is real) and ``BigramCompute`` below (a numpy bigram table with
exact gradients: no torch, milliseconds per call, for protocol and fault tests).

Losses follow Tinker's definitions: sums over target positions, ``loss:sum`` in the metrics.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from headrace.tinker_emulator.codec import WireDatum

Sequence3 = tuple[list[int], list[float], str]  # tokens, logprobs, "stop" | "length"


@dataclass(frozen=True)
class SampleSpec:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop_tokens: tuple[int, ...] = ()
    seed: int | None = None


class Sampler(Protocol):
    async def sample(self, prompt: list[int], n: int, spec: SampleSpec) -> list[Sequence3]: ...


class Trainer(Protocol):
    async def forward_backward(
        self, data: list[WireDatum], loss_fn: str, config: dict[str, Any], forward_only: bool
    ) -> tuple[list[list[float]], dict[str, float]]: ...

    async def optim_step(self, adam: dict[str, float]) -> dict[str, float]: ...

    async def save(self) -> Any:
        """An opaque snapshot of weights + optimizer state, kept by the emulator."""

    async def load(self, blob: Any, optimizer: bool) -> None: ...

    async def sampler(self) -> Sampler:
        """A sampler on a frozen copy of the current weights."""

    async def close(self) -> None: ...

    # optional: ``async def poison(self)``, the nan_loss fault: make the pending gradient non-finite


class Compute(Protocol):
    models: list[str]

    async def create(self, base_model: str, lora: dict[str, Any]) -> Trainer:
        """``lora``: Tinker's LoraConfig as sent (rank, seed, train_mlp, train_attn, train_unembed)."""

    async def base_sampler(self, base_model: str) -> Sampler: ...

    async def close(self) -> None: ...


LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo")


def loss_and_grad(
    loss_fn: str, config: dict[str, Any], logp: np.ndarray, inputs: dict[str, np.ndarray]
) -> tuple[float, np.ndarray]:
    """Tinker's loss on one datum's target logprobs, and dLoss/dlogp."""
    if loss_fn == "cross_entropy":
        w = inputs.get("weights", np.ones_like(logp))
        return float(-(w * logp).sum()), -w
    if loss_fn not in LOSSES:
        raise ValueError(f"loss '{loss_fn}' is not served by the emulator; use one of {', '.join(LOSSES)}")
    adv, old = inputs["advantages"], inputs["logprobs"]
    ratio = np.exp(logp - old)
    lo, hi = float(config.get("clip_low_threshold", 0.8)), float(config.get("clip_high_threshold", 1.2))
    if loss_fn == "importance_sampling":
        return float(-(ratio * adv).sum()), -ratio * adv
    if loss_fn == "ppo":
        clipped = np.clip(ratio, lo, hi)
        unclipped_active = ratio * adv <= clipped * adv
        return float(-np.minimum(ratio * adv, clipped * adv).sum()), np.where(unclipped_active, -ratio * adv, 0.0)
    clipped = np.clip(ratio, lo, hi)  # cispo: stop-gradient on the clipped ratio
    return float(-(clipped * adv * logp).sum()), -clipped * adv


class _BigramSampler:
    def __init__(self, table: np.ndarray, eos: int):
        self.table = table
        self.eos = eos

    async def sample(self, prompt: list[int], n: int, spec: SampleSpec) -> list[Sequence3]:
        rng = np.random.default_rng(spec.seed)
        stops = set(spec.stop_tokens) or {self.eos}
        out = []
        for _ in range(n):
            prev, toks, lps, stop = (prompt[-1] if prompt else 0), [], [], "length"
            for _ in range(spec.max_tokens):
                logits = self.table[prev]
                logp = logits - np.logaddexp.reduce(logits)
                scaled = logits / max(spec.temperature, 1e-6)
                p = np.exp(scaled - np.logaddexp.reduce(scaled))
                tok = int(rng.choice(len(p), p=p / p.sum()))
                toks.append(tok)
                lps.append(float(logp[tok]))
                prev = tok
                if tok in stops:
                    stop = "stop"
                    break
            out.append((toks, lps, stop))
        return out


class _BigramTrainer:
    def __init__(self, vocab: int, seed: int | None, eos: int):
        rng = np.random.default_rng(seed)
        self.w = rng.normal(0.0, 0.01, size=(vocab, vocab))
        self.grad = np.zeros_like(self.w)
        self.m = np.zeros_like(self.w)
        self.v = np.zeros_like(self.w)
        self.t = 0
        self.eos = eos

    async def forward_backward(self, data, loss_fn, config, forward_only):
        logprobs_D, total = [], 0.0
        for d in data:
            ctx = np.asarray(d.tokens, dtype=np.int64)
            tgt = d.inputs["target_tokens"].astype(np.int64)
            logz = np.logaddexp.reduce(self.w[ctx], axis=1)
            logp = self.w[ctx, tgt] - logz
            loss, dlogp = loss_and_grad(loss_fn, config, logp, d.inputs)
            total += loss
            logprobs_D.append(logp.astype(np.float32).tolist())
            if not forward_only:
                probs = np.exp(self.w[ctx] - logz[:, None])
                g = -probs * dlogp[:, None]
                g[np.arange(len(tgt)), tgt] += dlogp
                np.add.at(self.grad, ctx, g)
        return logprobs_D, {"loss:sum": total}

    async def optim_step(self, adam):
        lr, b1, b2 = adam.get("learning_rate", 1e-4), adam.get("beta1", 0.9), adam.get("beta2", 0.95)
        eps, wd, clip = adam.get("eps", 1e-12), adam.get("weight_decay", 0.0), adam.get("grad_clip_norm", 0.0)
        g = self.grad
        norm = float(np.sqrt((g * g).sum()))
        if clip and norm > clip:
            g = g * (clip / norm)
        self.t += 1
        self.m = b1 * self.m + (1 - b1) * g
        self.v = b2 * self.v + (1 - b2) * g * g
        mhat, vhat = self.m / (1 - b1**self.t), self.v / (1 - b2**self.t)
        self.w = self.w * (1 - lr * wd) - lr * mhat / (np.sqrt(vhat) + eps)
        self.grad = np.zeros_like(self.w)
        return {"grad_norm:mean": norm}

    async def poison(self):
        self.grad[:] = np.nan

    async def save(self):
        return copy.deepcopy({"w": self.w, "m": self.m, "v": self.v, "t": self.t})

    async def load(self, blob, optimizer):
        self.w = blob["w"].copy()
        if optimizer:
            self.m, self.v, self.t = blob["m"].copy(), blob["v"].copy(), blob["t"]
        self.grad = np.zeros_like(self.w)

    async def sampler(self):
        return _BigramSampler(self.w.copy(), self.eos)

    async def close(self):
        pass


class BigramCompute:
    """A numpy bigram "model" over headrace's char vocabulary: exact gradients, no torch."""

    def __init__(self) -> None:
        from headrace.tokenizers.char import CharTokenizer

        tok = CharTokenizer()
        self.vocab, self.eos = tok.vocab_size, tok.eos_token_id
        self.models = ["tiny"]

    async def create(self, base_model: str, lora: dict[str, Any]) -> Trainer:
        return _BigramTrainer(self.vocab, lora.get("seed"), self.eos)

    async def base_sampler(self, base_model: str) -> Sampler:
        return await _BigramTrainer(self.vocab, 0, self.eos).sampler()

    async def close(self) -> None:
        pass

"""Sequence packing (``torch.pack``): several datums a row, each with position ids from 0, which
transformers turns into a block-diagonal causal mask. The loss, its gradient and every logprob
must be the padded layout's."""

from __future__ import annotations

import random

import pytest

from tests.torch_helpers import config

from headrace.backends.torch import batches  # noqa: E402
from headrace.core.types import Datum, LossSpec  # noqa: E402
from headrace.run.backends import make_backend  # noqa: E402


def _datum(tokens: list[int], rng: random.Random) -> Datum:
    n = len(tokens) - 1
    weights = [0.0] * (n // 2) + [rng.choice([1.0, 0.5, 0.25]) for _ in range(n - n // 2)]
    return Datum(tokens[:-1], tokens[1:], [0.0] * n, [0.0] * n, weights)


def test_pack_places_each_datum_once_with_its_own_positions():
    import torch

    rng = random.Random(0)
    datums = [_datum([rng.randrange(1, 9) for _ in range(n + 1)], rng) for n in (7, 2, 5, 3, 1, 6)]
    batch = batches.pack(datums, pad_id=0, device=torch.device("cpu"))
    assert batch["input"].shape[1] == 7 and batch["input"].shape[0] < len(datums)  # rows of the longest, shared
    seen = set()
    for d, (r, s, n) in zip(datums, batch["spans"], strict=True):
        assert n == len(d.model_input) and batch["input"][r, s : s + n].tolist() == d.model_input
        assert batch["position_ids"][r, s : s + n].tolist() == list(range(n))
        assert batch["mask"][r, s : s + n].tolist() == d.mask
        seen |= {(r, s + j) for j in range(n)}
    assert len(seen) == sum(len(d.model_input) for d in datums)  # no two datums overlap
    assert int(batch["real"].sum()) == len(seen)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lora_rank", [0, 4])
async def test_packed_and_padded_batches_give_the_same_loss_gradient_and_logprobs(lora_rank, monkeypatch):
    from headrace.backends.torch import scoring

    packed_rows = []

    def pack(datums, pad_id, device, length=0):
        batch = batches.pack(datums, pad_id, device, length)
        packed_rows.append((len(datums), batch["input"].shape[0]))
        return batch

    monkeypatch.setattr(scoring, "pack", pack)
    results = {}
    for layout in (False, True):
        async with make_backend(config(lora_rank=lora_rank, pack=layout)) as backend:
            rng = random.Random(lora_rank)  # the same datums for both layouts
            vocab = backend.tokenizer.vocab_size
            datums = [_datum([rng.randrange(1, vocab) for _ in range(n)], rng) for n in (30, 5, 17, 9, 22, 3, 12)]
            learner = backend.training
            learner.scorer.microbatch_tokens = 48  # several passes (tiny's own budget holds them all)
            result = await learner.forward_backward(datums, LossSpec("cross_entropy"))
            grads = {n: p.grad.clone() for n, p in learner.params.items() if p.grad is not None}
            learner.optimizer.zero_grad(set_to_none=True)
            results[layout] = (result.metrics["optim/loss"], grads, result.logprobs_D)
    # packing ran: every datum, in passes of at most 48 tokens, each pass's datums in one row
    assert sum(n for n, _ in packed_rows) == 7 and all(rows == 1 for _, rows in packed_rows)
    assert max(n for n, _ in packed_rows) >= 3
    (loss, grads, logprobs), (loss2, grads2, logprobs2) = results[False], results[True]
    assert loss == pytest.approx(loss2, rel=1e-5)
    assert grads.keys() == grads2.keys() and grads
    for name, g in grads.items():
        assert float((g - grads2[name]).abs().max()) <= 1e-4 * float(g.abs().max()) + 1e-9, name
    for a, b in zip(logprobs, logprobs2, strict=True):
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4

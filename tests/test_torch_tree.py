"""Shared prefixes in the learner (``torch.share_prefix``): a group's common prompt computed once a
pass, each datum's own tokens attending to it through a 4-D mask. The loss, its gradient and
every logprob must be the padded layout's, including the loss positions inside the prefix (each
datum's own target there) and the frozen reference's."""

from __future__ import annotations

import random

import pytest

from tests.torch_helpers import config

from headrace.backends.torch import batches  # noqa: E402
from headrace.core.types import Datum, LossSpec  # noqa: E402
from headrace.run.backends import make_backend  # noqa: E402


def _datum(tokens: list[int], prompt: int, rng: random.Random, loss_in_prompt: bool = False) -> Datum:
    n = len(tokens) - 1
    mask = [0.0] * (prompt - 1) + [1.0] * (n - prompt + 1)
    if loss_in_prompt:  # SFT-like: some of the shared prompt is in the loss too
        mask[1] = mask[2] = 1.0
    advantages = [m * rng.choice([1.0, -1.0]) for m in mask]
    logprobs = [-rng.random() * m for m in mask]
    return Datum(tokens[:-1], tokens[1:], logprobs, advantages, mask)


def _groups(rng: random.Random, vocab: int, system: list[int], loss_in_prompt: bool = False) -> list[Datum]:
    """Three prompts behind one system prompt, a group of samples each (one duplicate, one
    sample that is a prefix of another), shuffled."""
    out = []
    for g, (prompt_len, samples) in enumerate([(9, 5), (6, 4), (11, 3)]):
        prompt = system + [rng.randrange(1, vocab) for _ in range(prompt_len)]
        answers = [[rng.randrange(1, vocab) for _ in range(rng.randrange(2, 9))] for _ in range(samples)]
        if g == 0:
            answers.append(list(answers[0]))  # the same sample twice
            answers.append(answers[1] + [rng.randrange(1, vocab)])  # one sample extending another
        for a in answers:
            out.append(_datum(prompt + a, len(prompt), rng, loss_in_prompt))
    rng.shuffle(out)
    return out


def test_trees_keep_each_prompt_and_not_only_the_system_prompt():
    rng = random.Random(0)
    system = [5, 6, 7, 8, 9, 10]
    datums = _groups(rng, 100, system)
    groups = batches.trees(datums, max_slots=1000)
    assert sorted(i for g in groups for i in g.members) == list(range(len(datums)))
    assert sorted(len(g.members) for g in groups) == [3, 4, 7]
    for g in groups:
        first = datums[g.members[0]].model_input
        assert g.shared >= len(system) + 6
        assert all(datums[i].model_input[: g.shared] == first[: g.shared] for i in g.members)
    # a row budget splits a group rather than exceeding it
    small = batches.trees(datums, max_slots=30)
    assert all(g.slots(datums) <= 30 or len(g.members) == 1 for g in small)
    assert len(small) > len(groups)


def test_tree_rows_hold_the_prefix_once_and_gather_back_every_datum():
    import torch

    rng = random.Random(1)
    datums = _groups(rng, 50, [3, 4])
    groups = batches.trees(datums, max_slots=1000)
    batch = batches.tree(groups, datums, 0, torch.device("cpu"), torch.float32)
    t = batch["tree"]
    assert t["input"].shape[0] == len(groups)
    assert t["input"].shape[1] == max(g.slots(datums) for g in groups) < sum(len(d.model_input) for d in datums) / 2
    rows, slots = t["gather"]
    order = [datums[i] for g in groups for i in g.members]
    for k, d in enumerate(order):
        n = len(d.model_input)
        assert t["input"][rows[k, :n], slots[k, :n]].tolist() == list(d.model_input)
        assert t["position_ids"][rows[k, :n], slots[k, :n]].tolist() == list(range(n))
        # each position sees exactly the datum's earlier positions
        seen = t["attention_mask"][rows[k, 0], 0][slots[k, :n]][:, slots[k, :n]] == 0
        assert torch.equal(seen, torch.ones(n, n, dtype=torch.bool).tril())
        assert batch["input"][k, :n].tolist() == list(d.model_input)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("lora_rank", "loss", "loss_in_prompt"), [(4, "importance_sampling", False), (0, "cross_entropy", True)]
)
async def test_shared_and_padded_passes_give_the_same_loss_gradient_and_logprobs(lora_rank, loss, loss_in_prompt):
    results = {}
    for share in (False, True):
        async with make_backend(config(lora_rank=lora_rank, share_prefix=share, pack=False)) as backend:
            rng = random.Random(7)  # the same datums for both layouts
            vocab = backend.tokenizer.vocab_size
            datums = _groups(rng, vocab, [rng.randrange(1, vocab) for _ in range(5)], loss_in_prompt)
            learner = backend.training
            learner.scorer.microbatch_tokens = 64  # several passes
            spec = LossSpec(loss, {"kl_coef": 0.1}) if lora_rank else LossSpec(loss)
            result = await learner.forward_backward(datums, spec)
            grads = {n: p.grad.clone() for n, p in learner.params.items() if p.grad is not None}
            learner.optimizer.zero_grad(set_to_none=True)
            scored = (await learner.forward(datums), await learner.reference_logprobs(datums))
            results[share] = (result.metrics["optim/loss"], grads, result.logprobs_D, scored, result.metrics)
    (loss0, grads0, logp0, scored0, m0), (loss1, grads1, logp1, scored1, m1) = results[False], results[True]
    assert loss0 == pytest.approx(loss1, rel=1e-5, abs=1e-7)
    if lora_rank:
        assert m0["loss/kl"] == pytest.approx(m1["loss/kl"], rel=1e-4, abs=1e-7)  # the reference's logprobs
    assert grads0.keys() == grads1.keys() and grads0
    for name, g in grads0.items():
        assert float((g - grads1[name]).abs().max()) <= 1e-4 * float(g.abs().max()) + 1e-9, name
    for a, b in zip(logp0 + scored0[0] + scored0[1], logp1 + scored1[0] + scored1[1], strict=True):
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def test_a_model_with_sliding_window_layers_keeps_its_padded_rows():
    from types import SimpleNamespace

    from headrace.backends.torch.scoring import _full_attention_only

    assert _full_attention_only(SimpleNamespace(layer_types=["full_attention"] * 3))
    assert _full_attention_only(SimpleNamespace())
    assert not _full_attention_only(SimpleNamespace(layer_types=["sliding_attention", "full_attention"]))
    assert not _full_attention_only(SimpleNamespace(use_sliding_window=True))

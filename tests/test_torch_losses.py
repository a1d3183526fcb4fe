"""Each loss on a hand-checked case: value, gradient sign, clipping, masking."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from headrace.backends.torch.losses import get_loss  # noqa: E402

CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def case(ratios, advantages, mask=None):
    """Learner logprobs chosen so exp(logp - sampler_logp) is exactly ``ratios``."""
    sampler = torch.full((1, len(ratios)), math.log(0.25))
    logp = (sampler + torch.tensor([[math.log(r) for r in ratios]])).requires_grad_()
    adv = torch.tensor([advantages], dtype=torch.float32)
    m = torch.tensor([mask if mask is not None else [1.0] * len(ratios)])
    return logp, sampler, adv, m


def run(name, logp, sampler, adv, mask, config=CLIP):
    loss, stats = get_loss(name)(logp, sampler, adv, mask, config)
    loss.backward()
    return float(loss.detach()), logp.grad[0].tolist(), {k: float(v) for k, v in stats.items()}


def test_importance_sampling_value_and_gradient():
    logp, sampler, adv, mask = case([1.0, 0.5], [1.0, -2.0])
    loss, grad, stats = run("importance_sampling", logp, sampler, adv, mask)
    assert loss == pytest.approx(-(1.0 * 1.0 + 0.5 * -2.0))
    # d(-ratio*A)/dlogp = -ratio*A: a positive advantage raises the token's logprob
    assert grad == pytest.approx([-1.0, 1.0])
    assert stats["ratio"] == pytest.approx(1.5)


def test_ppo_clips_only_where_it_should():
    # ratio 1.5, A>0: clipped at 1.2, no gradient; ratio 0.5, A>0: unclipped;
    # ratio 0.5, A<0: clipped at 0.8, no gradient; ratio 1.5, A<0: unclipped (pessimistic)
    logp, sampler, adv, mask = case([1.5, 0.5, 0.5, 1.5], [1.0, 1.0, -1.0, -1.0])
    loss, grad, stats = run("ppo", logp, sampler, adv, mask)
    assert loss == pytest.approx(-(1.2 + 0.5 - 0.8 - 1.5))
    assert grad == pytest.approx([0.0, -0.5, 0.0, 1.5])
    assert stats["clipped"] == 2.0


def test_ppo_thresholds_come_from_the_config():
    logp, sampler, adv, mask = case([1.5], [1.0])
    loss, grad, _ = run("ppo", logp, sampler, adv, mask, {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0})
    assert loss == pytest.approx(-1.5) and grad == pytest.approx([-1.5])


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    logp, sampler, adv, mask = case([1.5, 1.0, 0.5], [1.0, -1.0, 2.0])
    loss, grad, stats = run("cispo", logp, sampler, adv, mask)
    weights = [1.2, 1.0, 0.8]  # clip(ratio) as a constant
    assert grad == pytest.approx([-w * a for w, a in zip(weights, [1.0, -1.0, 2.0], strict=True)])
    lp = logp.detach()[0].tolist()
    assert loss == pytest.approx(-sum(w * a * x for w, a, x in zip(weights, [1.0, -1.0, 2.0], lp, strict=True)))
    assert stats["clipped"] == 2.0


def test_cross_entropy_ignores_advantages():
    logp, sampler, adv, mask = case([1.0, 1.0], [5.0, -5.0])
    loss, grad, _ = run("cross_entropy", logp, sampler, adv, mask)
    assert loss == pytest.approx(-float(logp.detach().sum()))
    assert grad == pytest.approx([-1.0, -1.0])


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "cross_entropy"])
def test_masked_tokens_contribute_nothing_even_when_extreme(name):
    logp, sampler, adv, mask = case([1.0, 1.0], [1.0, 1.0], mask=[1.0, 0.0])
    with torch.no_grad():
        logp[0, 1] = -float("inf")  # e.g. a padded position
    adv[0, 1] = 1e6
    loss, grad, _ = run(name, logp, sampler, adv, mask)
    assert math.isfinite(loss)
    assert grad[1] == 0.0 and math.isfinite(grad[0]) and grad[0] != 0.0


def test_unknown_loss_names_the_valid_ones():
    with pytest.raises(ValueError, match="importance_sampling, ppo, cispo, cross_entropy"):
        get_loss("grpo")

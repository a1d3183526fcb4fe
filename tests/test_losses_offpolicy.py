"""Off-policy corrections: each loss's value and gradient on hand-checked tensors, the reference
KL and the aggregations on the tiny model, option validation (Tinker's mapping:
test_losses_tinker.py; learning at staleness 4: test_torch_learning.py)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from headrace.backends.torch.losses import LossInputs, compute, kl_estimate  # noqa: E402
from headrace.core.errors import ConfigError  # noqa: E402
from headrace.core.learner import StepReport  # noqa: E402
from headrace.core.types import ForwardBackwardResult, LossSpec  # noqa: E402
from headrace.run.config import build_config  # noqa: E402
from headrace.run.metrics import learner_metrics  # noqa: E402

BEHAV = math.log(0.25)


def tensors(rows_ratios, rows_adv, prox_ratios=None):
    """Logprobs such that exp(logp - sampler) is exactly each ratio (and exp(prox - sampler) each
    prox ratio); rows padded with mask 0."""
    width = max(len(r) for r in rows_ratios)

    def pad(rows, fill):
        return torch.tensor([list(r) + [fill] * (width - len(r)) for r in rows], dtype=torch.float32)

    mask = pad([[1.0] * len(r) for r in rows_ratios], 0.0)
    sampler = torch.full(mask.shape, BEHAV)
    logp = (sampler + pad([[math.log(x) for x in r] for r in rows_ratios], 0.0)).requires_grad_()
    prox = None if prox_ratios is None else sampler + pad([[math.log(x) for x in r] for r in prox_ratios], 0.0)
    return LossInputs(logp, sampler, pad(rows_adv, 0.0), mask, prox_logp=prox)


def run(name, inputs, config=None, weight=None):
    total, stats = compute(name, inputs, config or {}, weight)
    total.backward()
    grads = [
        [g for g, m in zip(gr, mr, strict=True) if m]
        for gr, mr in zip(inputs.logp.grad.tolist(), inputs.mask.tolist(), strict=True)
    ]
    return float(total.detach()), grads, {k: (None if v is None else float(v)) for k, v in stats.items()}


# ---- the losses, by hand ----


def test_tis_truncates_the_weight_and_keeps_its_gradient_below_the_cap():
    # the learner is the proximal policy (one update per step): weight = ratio, truncated at 2
    loss, grads, stats = run("tis", tensors([[0.5, 1.0, 3.0]], [[1.0, -1.0, 2.0]]), {"is_cap": 2.0})
    assert loss == pytest.approx(-(0.5 * 1.0 + 1.0 * -1.0 + 2.0 * 2.0))
    assert grads == [pytest.approx([-0.5, 1.0, -4.0])]  # -min(w, C) * A: a truncated token still learns
    assert stats["clipped"] == 1 and stats["masked"] == 0
    assert stats["ratio"] == pytest.approx(4.5) and stats["ratio_max"] == pytest.approx(3.0)
    assert stats["ratio_min"] == pytest.approx(0.5)


def test_tis_without_a_cap_is_importance_sampling():
    a = run("tis", tensors([[0.5, 3.0]], [[1.0, -2.0]]), {"is_cap": 1e9})
    b = run("importance_sampling", tensors([[0.5, 3.0]], [[1.0, -2.0]]))
    assert a[0] == pytest.approx(b[0]) and a[1] == [pytest.approx(b[1][0])]


def test_mis_drops_tokens_outside_the_bounds_and_keeps_the_others_weight():
    loss, grads, stats = run("mis", tensors([[0.4, 1.0, 2.5, 1.5]], [[1.0, 1.0, 1.0, -1.0]]))  # bounds 0.5, 2
    assert loss == pytest.approx(-(1.0 * 1.0 + 1.5 * -1.0))
    assert grads == [pytest.approx([0.0, -1.0, 0.0, 1.5])]
    assert stats["masked"] == 2 and stats["clipped"] == 0


def test_mis_at_sequence_level_drops_whole_sequences_by_their_geometric_mean():
    # row 0: weights 4, 4 -> 4, out of [0.5, 2]; row 1: 2 and 0.5 -> 1, both tokens weigh 1
    inputs = tensors([[4.0, 4.0], [2.0, 0.5]], [[1.0, 1.0], [1.0, -3.0]])
    loss, grads, stats = run("mis", inputs, {"is_level": "sequence"})
    assert loss == pytest.approx(-(1.0 - 3.0))
    assert grads == [pytest.approx([0.0, 0.0]), pytest.approx([-1.0, 3.0])]
    assert stats["masked"] == 2


def test_decoupled_ppo_clips_around_the_proximal_policy_and_truncates_the_behaviour_weight():
    # behaviour weights prox/behav = 1.5, 3 (capped at 2), 1; trust-region ratios learner/prox = 1, 1, 1.5
    inputs = tensors([[1.5, 3.0, 1.5]], [[1.0, -1.0, 1.0]], prox_ratios=[[1.5, 3.0, 1.0]])
    loss, grads, stats = run("decoupled_ppo", inputs, {"is_cap": 2.0})
    assert loss == pytest.approx(-(1.5 * 1.0) - (2.0 * -1.0) - (1.0 * 1.2))
    assert grads == [pytest.approx([-1.5, 2.0, 0.0])]  # the clipped token (ratio 1.5 > 1.2, A > 0) is still
    assert stats["clipped"] == 2  # one truncated weight, one clipped ratio


def test_decoupled_ppo_at_the_start_of_a_step_is_tis():
    # prox = the learner's own logprobs (the trainer's case): ratio learner/prox is 1 in value
    a = run("decoupled_ppo", tensors([[0.5, 3.0, 1.1]], [[1.0, -2.0, 0.5]]), {"is_cap": 2.0})
    b = run("tis", tensors([[0.5, 3.0, 1.1]], [[1.0, -2.0, 0.5]]), {"is_cap": 2.0})
    assert a[0] == pytest.approx(b[0]) and a[1] == [pytest.approx(b[1][0])]


def test_gspo_gives_every_token_the_sequence_ratio_and_clips_whole_sequences():
    # row 0: ratios 2, 0.5 -> s = 1, unclipped; row 1: 2, 2 -> s = 2: clipped where A > 0, not where A < 0
    inputs = tensors([[2.0, 0.5], [2.0, 2.0], [2.0, 2.0]], [[1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]])
    loss, grads, stats = run("gspo", inputs)
    assert loss == pytest.approx(-(1.0 - 1.0) - 2 * 1.2 - 2 * (2.0 * -1.0))
    # each token's gradient is s * A (its own logprob's), zero where the clip holds
    assert grads == [pytest.approx([-1.0, 1.0]), pytest.approx([0.0, 0.0]), pytest.approx([2.0, 2.0])]
    assert stats["clipped"] == 2


@pytest.mark.parametrize(
    ("estimator", "value", "slope"), [("k1", math.log(2), 1.0), ("k3", 0.5 + math.log(0.5) * -1 - 1, 0.5)]
)
def test_kl_penalty_value_and_gradient(estimator, value, slope):
    # learner 0.5, reference 0.25: k1 = log 2; k3 = r - log r - 1 with r = 0.5; d k3/d logp = 1 - r
    inputs = tensors([[2.0]], [[0.0]])  # advantage 0: the penalty alone
    inputs.ref_logp = torch.full_like(inputs.sampler_logp, math.log(0.25))
    loss, grads, stats = run("importance_sampling", inputs, {"kl_coef": 0.1, "kl_estimator": estimator})
    assert loss == pytest.approx(0.1 * value) and stats["kl_ref"] == pytest.approx(value)
    assert grads == [pytest.approx([0.1 * slope])]
    assert kl_estimate(torch.tensor([0.3]), torch.tensor([0.3]), estimator).item() == 0.0


@pytest.mark.parametrize("name", ["decoupled_ppo", "tis", "mis", "gspo"])
def test_masked_positions_cannot_poison_the_new_losses(name):
    inputs = tensors([[1.0, 1.0], [1.0]], [[1.0, -1.0], [2.0]])
    with torch.no_grad():
        inputs.logp[1, 1] = -math.inf  # padding
    inputs.adv[1, 1] = 1e30
    loss, grads, _ = run(name, inputs)
    assert math.isfinite(loss) and all(math.isfinite(g) for row in inputs.logp.grad.tolist() for g in row)
    assert inputs.logp.grad[1, 1] == 0.0


def test_ratio_statistics_reach_the_step_row_by_their_reduction():
    calls = [
        ForwardBackwardResult([], {"loss/ratio_mean": 1.0, "loss/ratio_max:max": 3.0, "loss/ratio_min:min": 0.5}),
        ForwardBackwardResult([], {"loss/ratio_mean": 2.0, "loss/ratio_max:max": 5.0, "loss/ratio_min:min": 0.7}),
    ]
    row = learner_metrics(StepReport(0, [], calls, None, 1, None, 0.0))
    assert row["loss/ratio_mean"] == 1.5 and row["loss/ratio_max"] == 5.0 and row["loss/ratio_min"] == 0.5


# ---- options ----


def test_loss_options_reach_the_backend_as_the_spec():
    config = build_config(overrides=["loss.name=tis", "loss.is_cap=3", "loss.aggregation=dr_grpo", "loss.kl_coef=0.05"])
    spec = config.loss.spec(config.sampling.max_tokens)
    assert spec == LossSpec(
        "tis",
        {
            "is_cap": 3.0,
            "is_level": "token",
            "aggregation": "dr_grpo",
            "normalizer": float(config.sampling.max_tokens),
            "kl_coef": 0.05,
            "kl_estimator": "k3",
        },
    )
    # the defaults send what they sent before these options existed
    ppo = build_config(overrides=["loss.name=ppo"]).loss.spec(4)
    assert ppo == LossSpec("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["loss.name=tsi"], "did you mean 'tis'"),
        (["loss.name=ppo", "loss.is_cap=3"], "loss.is_cap=3.0 does nothing with loss 'ppo' (only tis, decoupled_ppo"),
        (["loss.mis_high=4"], "only mis read it"),
        (["loss.normalizer=16"], "only dr_grpo reads it"),
        (["loss.kl_estimator=k1"], "does nothing while loss.kl_coef is 0"),
        (["loss.name=tis", "loss.is_cap=0.5"], "loss.is_cap: Input should be greater than or equal to 1"),
        (["loss.name=ppo", "loss.clip_high_threshold=0.9"], "greater than or equal to 1"),
        (["loss.aggregation=dr"], "'token_mean', 'sequence_mean' or 'dr_grpo'"),
        (["loss.kl_coef=-1"], "greater than or equal to 0"),
    ],
)
def test_bad_loss_options_are_one_clear_paragraph(overrides, says):
    with pytest.raises(ConfigError) as err:
        build_config(overrides=overrides)
    assert says in str(err.value) and "\n" not in str(err.value)


# ---- the torch trainer: aggregation, reference KL ----

pytest.importorskip("transformers")

from headrace.core.types import AdamParams, Datum  # noqa: E402
from headrace.run.backends import make_backend  # noqa: E402
from tests.torch_helpers import config as torch_config  # noqa: E402


def _datums(tokenizer, lengths=(1, 3), advantage=1.0):
    prompt = tokenizer.encode("3+4=")
    out = []
    for i, n in enumerate(lengths):
        action = tokenizer.encode("7" * n)
        seq = prompt + action
        mask = [0.0] * (len(prompt) - 1) + [1.0] * n
        a = advantage if i % 2 == 0 else -advantage
        out.append(Datum(seq[:-1], seq[1:], [-1.0 * m for m in mask], [a * m for m in mask], mask))
    return out


def _raw_grads(trainer):
    grads = {n: p.grad.clone() for n, p in trainer.params.items() if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    norm, trainer.loss_norm, trainer.loss_tokens = trainer.loss_norm, 0.0, 0
    return grads, norm


@pytest.mark.timeout(60)
async def test_aggregations_weigh_tokens_and_divide_as_documented():
    async with make_backend(torch_config()) as backend:
        trainer = backend.training
        short, long = _datums(backend.tokenizer, (1, 3))
        one = {}
        for d in (short, long):
            await trainer.forward_backward([d], LossSpec("importance_sampling"))
            one[d.num_loss_tokens] = _raw_grads(trainer)[0]
        await trainer.forward_backward([short, long], LossSpec("importance_sampling", {"aggregation": "sequence_mean"}))
        grads, norm = _raw_grads(trainer)
        assert norm == 2.0  # two sequences
        for name, g in grads.items():  # each sequence's tokens weigh 1 / its length
            assert torch.allclose(g, one[1][name] + one[3][name] / 3, atol=1e-6)
        await trainer.forward_backward(
            [short, long], LossSpec("importance_sampling", {"aggregation": "dr_grpo", "normalizer": 8.0})
        )
        grads, norm = _raw_grads(trainer)
        assert norm == 2 * 8.0  # sequences x normalizer, not the 4 tokens
        for name, g in grads.items():  # no per-sequence length normalisation
            assert torch.allclose(g, one[1][name] + one[3][name], atol=1e-6)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("lora_rank", [0, 4])
async def test_reference_kl_is_zero_at_the_start_and_grows_with_training(lora_rank):
    spec = LossSpec("importance_sampling", {"kl_coef": 0.1, "kl_estimator": "k3"})
    async with make_backend(torch_config(lora_rank=lora_rank)) as backend:
        trainer = backend.training
        datums = _datums(backend.tokenizer, (2, 3, 1, 2))
        plain = await trainer.forward_backward(datums, LossSpec("importance_sampling"))
        assert "loss/kl" not in plain.metrics and trainer.scorer.reference is None  # kl_coef 0: no reference at all
        kls = []
        for _ in range(4):
            result = await trainer.forward_backward(datums, spec)
            kls.append(result.metrics["loss/kl"])
            await trainer.optim_step(AdamParams(learning_rate=1e-3))
        assert kls[0] == pytest.approx(0.0, abs=1e-7), "the reference is the initial model: no divergence at step 0"
        assert min(kls[1:]) > 1e-5, f"every update moves the policy away from the reference: {kls}"
        if lora_rank:
            assert trainer.scorer.reference is None  # the adapter is disabled instead: no second model


async def test_torch_refuses_a_bad_loss_before_the_run():
    async with make_backend(torch_config()) as backend:
        with pytest.raises(ConfigError, match="is_cap must be at least 1"):
            backend.training.check_loss(LossSpec("tis", {"is_cap": 0.5}))
        backend.training.check_loss(LossSpec("gspo", {"kl_coef": 0.1}))  # full fine-tuning rebuilds the reference

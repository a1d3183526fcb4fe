"""Off-policy losses on the Tinker backend: its built-in losses are mapped, the rest refused with
the reason and the names that work, and the ratio statistics computed from its logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tinker_support import emulator, run_config, tinker_env  # noqa: F401

from headrace.backends.tinker import convert
from headrace.core.errors import ConfigError
from headrace.core.types import Datum, LossSpec
from headrace.run.train import train

pytestmark = pytest.mark.tinker

D = Datum([1, 2, 3], [2, 3, 4], [0.0, -0.5, -0.7], [0.0, 2.0, 2.0], [0.0, 1.0, 1.0])
WORK = "importance_sampling, ppo, cispo, gspo, cross_entropy"


def test_gspo_maps_to_tinkers_gspo_with_its_ratio_mask_and_clip_bounds():
    spec = LossSpec("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    datum = convert.to_datum(D, spec)
    assert datum.loss_fn_inputs["sequence_ratio_mask"].to_numpy().tolist() == [0.0, 1.0, 1.0]
    assert convert.loss_config(spec) == {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}


def test_aggregations_scale_each_datums_advantages():
    seq = convert.to_datum(D, LossSpec("ppo", {"aggregation": "sequence_mean"}))
    assert np.allclose(seq.loss_fn_inputs["advantages"].to_numpy(), [0.0, 1.0, 1.0])  # 2 / its 2 tokens
    dr = convert.to_datum(D, LossSpec("ppo", {"aggregation": "dr_grpo", "normalizer": 8.0}))
    assert np.allclose(dr.loss_fn_inputs["advantages"].to_numpy(), [0.0, 0.25, 0.25])
    ce = convert.to_datum(D, LossSpec("cross_entropy", {"aggregation": "sequence_mean"}))
    assert np.allclose(ce.loss_fn_inputs["weights"].to_numpy(), [0.0, 0.5, 0.5])


@pytest.mark.parametrize(("name", "why"), [("decoupled_ppo", "proximal"), ("tis", "truncates"), ("mis", "masks")])
def test_losses_tinker_cannot_compute_are_refused_with_the_reason(name, why):
    with pytest.raises(ConfigError, match=f"(?s)loss '{name}' cannot run on the tinker backend.*{why}.*{WORK}"):
        convert.to_datum(D, LossSpec(name))


def test_a_kl_penalty_is_refused_on_tinker():
    with pytest.raises(ConfigError, match="loss.kl_coef > 0 cannot run on the tinker backend.*no KL term"):
        convert.loss_config(LossSpec("ppo", {"kl_coef": 0.1}))


def test_ratio_statistics_come_from_the_services_logprobs():
    stats = convert.ratio_stats([D], [[0.0, -0.5 + math.log(2), -0.7]])
    assert stats == {
        "loss/ratio_mean": pytest.approx(1.5),
        "loss/ratio_max:max": pytest.approx(2.0),
        "loss/ratio_min:min": pytest.approx(1.0),
    }


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_tinker_run_with_tis_stops_with_the_reason(tmp_path):
    with emulator("bigram", clock_cycle_s=0.05, follow_s=0) as emu:
        config = run_config(emu.url, tmp_path / "run", set={"loss.name": "tis"})
        with pytest.raises(ConfigError, match=f"loss 'tis' cannot run on the tinker backend.*{WORK}"):
            await train(config)


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_tinker_run_logs_the_importance_ratio(tmp_path):
    with emulator("bigram", clock_cycle_s=0.05, follow_s=0) as emu:
        config = run_config(emu.url, tmp_path / "run", set={"loss.name": "ppo", "advantages.filter_constant": "false"})
        summary = await train(config)
    assert len(summary.metrics) == config.steps
    for row in summary.metrics:  # the sampler and the service agree here: the ratio is 1 up to rounding
        assert row["loss/ratio_min"] == pytest.approx(1.0, abs=1e-3)
        assert row["loss/ratio_min"] <= row["loss/ratio_mean"] <= row["loss/ratio_max"] == pytest.approx(1.0, abs=1e-3)

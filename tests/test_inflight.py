"""The inflight scheduler: per-token versions, the sim's mid-generation swap, the gate's
staleness bound, the refusal on samplers that cannot swap, and its ideal bound."""

from __future__ import annotations

import asyncio

import pytest
from helpers import run_sim

from headrace.backends.sim import VERSION_BASE, SimConfig, SimSampling
from headrace.bench.ideal import GroupWork, Work, inflight_bound
from headrace.core.errors import ConfigError
from headrace.core.sampler import SamplerActor
from headrace.core.types import SampledTokens, SamplerHandle, SamplingParams, StopReason
from headrace.plugins import registry
from headrace.run.scheduling import make_scheduler
from headrace.schedulers.inflight import InflightRegenerate
from headrace.tokenizers.char import CharTokenizer

pytestmark = pytest.mark.timeout(60)

# sampling slow and jittery with a long tail (and room for it), training fast: generations span
# weight updates
TAIL = {"sim.sample_token_s": 0.002, "sim.sample_jitter": 0.5, "sim.length_sigma": 1.2, "sim.train_token_s": 0.00001,
        "sampling.max_tokens": 8}  # fmt: skip


def test_token_versions_default_to_the_call_version_and_must_agree():
    one = SampledTokens([1, 2, 3], [0.0] * 3, StopReason.STOP, 4)
    assert one.versions == [4, 4, 4]
    mixed = SampledTokens([1, 2, 3], [0.0] * 3, StopReason.STOP, 4, (4, 5, 5))
    assert mixed.versions == [4, 5, 5]
    with pytest.raises(ValueError, match="oldest token"):
        SampledTokens([1, 2], [0.0] * 2, StopReason.STOP, 5, (4, 5))
    with pytest.raises(ValueError, match="one version per sampled token"):
        SampledTokens([1, 2], [0.0] * 2, StopReason.STOP, 4, (4,))


class _OneVersionSampler:
    """A backend that serves each call with one set of weights and stamps nothing (torch, vLLM)."""

    async def sample(self, handle, prompt, n, params):
        return [SampledTokens([7, 8], [-1.0, -1.0], StopReason.STOP) for _ in range(n)]


async def test_sampler_stamps_every_token_of_a_call_with_its_version():
    actor = SamplerActor(_OneVersionSampler(), SamplerHandle(3))
    (sample,) = await actor.sample([1], 1, SamplingParams())
    assert sample.policy_version == 3 and sample.versions == [3, 3]
    with pytest.raises(ValueError, match="cannot swap"):
        SamplerActor(_OneVersionSampler(), SamplerHandle(0), swap_in_flight=True)


async def test_sim_request_running_across_a_swap_takes_the_new_weights_for_later_tokens():
    cfg = SimConfig(sample_request_s=0.01, sample_token_s=0.01, action_tokens=20)
    sim = SimSampling(cfg, CharTokenizer(), seed=0)
    sim.swap_weights(SamplerHandle(0))  # swap mode on, version 0
    task = asyncio.ensure_future(sim.sample(SamplerHandle(0), [1, 2], 2, SamplingParams(max_tokens=64)))
    await asyncio.sleep(0.1)  # about 9 tokens in
    sim.swap_weights(SamplerHandle(1))
    for sample in await task:
        versions = sample.versions
        assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
        assert 3 <= versions.index(1) <= 16  # the swap lands mid-generation
        assert sample.tokens[0] == VERSION_BASE + 0 and sample.policy_version == 0
    # a request that starts after the swap is served by the new weights from its first token
    (later,) = await sim.sample(SamplerHandle(0), [1, 2], 1, SamplingParams(max_tokens=64))
    assert set(later.versions) == {1} and later.tokens[0] == VERSION_BASE + 1


def test_inflight_refuses_a_sampler_that_cannot_swap(tmp_path):
    from helpers import sim_config

    scheduler = make_scheduler(sim_config(tmp_path, scheduler="inflight"))
    with pytest.raises(ConfigError, match="cannot .*async.*sim"):
        scheduler.check_backend(_OneVersionSampler())
    scheduler.check_backend(SimSampling(SimConfig(), CharTokenizer(), 0))  # sim can


@pytest.mark.parametrize("off_policy", [1, 2])
async def test_inflight_bounds_the_oldest_token_and_trains_every_group(tmp_path, off_policy):
    steps, batch = 10, 4
    summary = await run_sim(
        tmp_path, scheduler="inflight", max_steps_off_policy=off_policy, steps=steps, batch_size=batch, set=TAIL
    )
    trained = summary.backend.training.trained_versions  # (step, version of the datum's first token)
    lags = [step - version for step, version in trained]
    assert lags and 0 <= min(lags) and max(lags) <= off_policy
    rows = summary.metrics
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["staleness/max"] <= off_policy for r in rows)
    assert sum(r["groups/trained"] + r["groups/filtered"] for r in rows) == steps * batch  # none dropped
    # weights were swapped into running generations: some tokens are newer than their trajectory's oldest
    assert any(r["staleness/token_mean"] < r["staleness/token_weighted"] for r in rows)
    assert summary.backend.sampling.swaps, "the sampler was never given weights in flight"
    # the ledger's figures, reported: holding restarts nothing
    assert rows[-1]["inflight/regenerated"] == 0 and rows[-1]["inflight/held_s"] >= 0
    print(f"held {rows[-1]['inflight/held_s']:.3f} s in all")


async def test_regenerate_restarts_overdue_groups_within_the_bound(tmp_path):
    with registry.schedulers.temporarily("inflight_regenerate", InflightRegenerate):
        summary = await run_sim(
            tmp_path, scheduler="inflight_regenerate", max_steps_off_policy=1, steps=10, batch_size=4, set=TAIL
        )
    lags = [step - version for step, version in summary.backend.training.trained_versions]
    assert lags and max(lags) <= 1
    assert len(summary.metrics) == 10
    regenerated = [r["inflight/regenerated"] for r in summary.metrics]
    assert regenerated == sorted(regenerated)  # counted over the run
    print(f"regenerated {regenerated[-1]:.0f} groups, held {summary.metrics[-1]['inflight/held_s']:.3f} s")


def test_inflight_bound_replays_admission_slots_and_training():
    # 2 steps of 2 single-request groups, 2 slots, m = 0: step 0 = groups 0, 1 (1 s each), trained
    # 0.5 s; step 1's groups are admitted only once version 1 is published
    groups = [GroupWork(1.0, 1.0, 1.0), GroupWork(1.0, 1.0, 1.0)]
    work = Work([groups, groups], [[("forward_backward", 0.5), ("publish", 0.0)]] * 2)
    assert inflight_bound(work, 0, 2, 2).ideal_s == pytest.approx(3.0)
    # m = 1: step 1's groups sample while step 0 trains, but wait for slots (2 slots, 4 groups)
    assert inflight_bound(work, 1, 2, 2).ideal_s == pytest.approx(2.5)
    # m = 1 and 4 slots: all four at once
    assert inflight_bound(work, 1, 2, 4).ideal_s == pytest.approx(2.0)
    # a member's own requests follow its env's tool time
    agent = [GroupWork(2.0, 2.0, 0.5, ((0.5, 0.5),)), GroupWork(2.0, 2.0, 0.5, ((0.5, 0.5),))]
    work = Work([agent], [[("forward_backward", 0.0), ("publish", 0.0)]])
    assert inflight_bound(work, 0, 2, 2, env_step_s=0.25).ideal_s == pytest.approx(0.5 + 2 * 0.75)

"""Each scheduler end to end on sim, and the semantics that tell them apart."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from helpers import run_sim

from headrace.core.trace import CallCompleted, CallSubmitted

pytestmark = pytest.mark.timeout(60)

LATENCY = {"sim.sample_token_s": 0.0005, "sim.train_token_s": 0.00005, "sim.optim_step_s": 0.002}


@pytest.mark.parametrize("scheduler", ["sync", "stream", "async"])
@pytest.mark.parametrize("env", ["arithmetic", "guess_number"])
async def test_each_scheduler_runs_both_envs(tmp_path, scheduler, env):
    summary = await run_sim(tmp_path, scheduler=scheduler, env=env, steps=5, num_minibatches=2, set=LATENCY)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == list(range(5))
    for row in rows:
        for key in ("reward/mean", "staleness/mean", "staleness/max", "time/step"):
            assert key in row
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4, 5]
    assert summary.backend.training.applied_steps == 5
    assert (tmp_path / "run" / "config.json").exists() and (tmp_path / "run" / "log.jsonl").exists()


def _trained_by_step(backend) -> dict[int, list[int]]:
    by_step = defaultdict(list)
    for step, version in backend.training.trained_versions:
        by_step[step].append(version)
    return {k: sorted(v) for k, v in by_step.items()}


async def test_async_with_zero_off_policy_is_sync(tmp_path):
    sync = await run_sim(tmp_path / "a", scheduler="sync", steps=6, set=LATENCY)
    asyn = await run_sim(tmp_path / "b", scheduler="async", max_steps_off_policy=0, steps=6, set=LATENCY)
    assert _trained_by_step(sync.backend) == _trained_by_step(asyn.backend)
    keys = ("reward/mean", "groups/trained", "groups/filtered", "staleness/max", "throughput/action_tokens")
    assert [[r[k] for k in keys] for r in sync.metrics] == [[r[k] for k in keys] for r in asyn.metrics]
    assert all(r["staleness/max"] == 0 for r in asyn.metrics)


@pytest.mark.parametrize("off_policy", [1, 2])
async def test_staleness_bounded_by_admission_from_stamped_tokens(tmp_path, off_policy):
    # sampling slow and jittery, training fast: sampling runs as far ahead as it may
    latency = {"sim.sample_token_s": 0.002, "sim.sample_jitter": 1.0, "sim.train_token_s": 0.00001}
    summary = await run_sim(
        tmp_path, scheduler="async", max_steps_off_policy=off_policy, steps=10, batch_size=4, set=latency
    )
    trained = summary.backend.training.trained_versions
    assert trained, "nothing was trained"
    lags = [step - version for step, version in trained]
    assert max(lags) <= off_policy
    assert min(lags) >= 0
    assert max(lags) >= 1, "async never ran ahead: the test does not exercise staleness"
    assert max(r["staleness/max"] for r in summary.metrics) <= off_policy


async def test_sync_and_stream_are_on_policy(tmp_path):
    for scheduler in ("sync", "stream"):
        summary = await run_sim(tmp_path / scheduler, scheduler=scheduler, steps=4, num_minibatches=2, set=LATENCY)
        assert {step - version for step, version in summary.backend.training.trained_versions} == {0}


def _spans(backend, op):
    return [s for s in backend.training.timeline if s.op == op]


async def test_learner_queues_optim_before_forward_backward_finishes(tmp_path):
    latency = {"sim.train_token_s": 0.0005, "sim.optim_step_s": 0.01, "advantages.filter_constant": "false"}
    summary = await run_sim(tmp_path, scheduler="sync", steps=4, set=latency)
    timeline = list(summary.backend.training.timeline)
    fbs = [i for i, span in enumerate(timeline) if span.op == "forward_backward"]
    assert len(fbs) == 4, f"expected one forward_backward per step, the sim saw {len(fbs)}"
    for i in fbs:
        nxt = timeline[i + 1]
        assert nxt.op == "optim_step"
        assert nxt.submitted < timeline[i].end, "optim_step was submitted only after forward_backward finished"


async def test_async_learner_submits_next_step_before_previous_finishes(tmp_path):
    # fast sampling, slow training: batch k+1 is ready while step k is still on the device
    latency = {"sim.train_step_s": 0.02, "sim.optim_step_s": 0.02, "advantages.filter_constant": "false"}
    summary = await run_sim(tmp_path, scheduler="async", max_steps_off_policy=2, steps=6, set=latency)
    fbs, optims = _spans(summary.backend, "forward_backward"), _spans(summary.backend, "optim_step")
    overlapped = [k for k in range(1, len(fbs)) if fbs[k].submitted < optims[k - 1].end]
    assert overlapped, "the next forward_backward was never queued before the previous step finished"
    # and the device never sat idle between steps once the pipeline was full
    gaps = [fbs[k].start - optims[k - 1].end for k in overlapped]
    assert max(gaps) < 1e-6


async def test_stream_submits_a_forward_backward_per_minibatch(tmp_path):
    latency = {"sim.sample_token_s": 0.01, "sim.sample_jitter": 0.9, "advantages.filter_constant": "false"}
    summary = await run_sim(tmp_path, scheduler="stream", num_minibatches=2, batch_size=4, steps=3, set=latency)
    timeline = summary.backend.training.timeline
    ops = [s.op for s in timeline if s.op in ("forward_backward", "optim_step")]
    assert ops == ["forward_backward", "forward_backward", "optim_step"] * 3
    # each step's first minibatch went out while the rest of its batch was still sampling: before
    # the batch's last sample request finished (both as the run's trace saw them)
    events = summary.trace.events
    last_sample: dict[int, float] = defaultdict(float)
    for e in events:
        if isinstance(e, CallCompleted) and e.op == "sample" and e.rollout is not None:
            last_sample[e.rollout[0]] = max(last_sample[e.rollout[0]], e.at)
    fbs = [e.at for e in events if isinstance(e, CallSubmitted) and e.op == "forward_backward"]
    early = [fbs[2 * k] < last_sample[k] for k in range(3)]
    assert all(early), f"the first minibatch waited for the whole batch (per step: {early})"
    assert all(r["optim/forward_backward_calls"] == 2 for r in summary.metrics)


def test_stream_refuses_a_batch_that_does_not_split_into_its_minibatches():
    from headrace.core.errors import ConfigError
    from headrace.plugins import registry
    from headrace.run.config import build_config
    from headrace.run.scheduling import scheduler_options

    config = build_config(overrides=["scheduler=stream", "batch_size=6", "num_minibatches=4"])
    with pytest.raises(ConfigError, match="multiple of the number of minibatches"):
        registry.schedulers.get("stream")(scheduler_options(config))
    registry.schedulers.get("sync")(scheduler_options(config))  # fine where minibatches are not used


async def test_each_row_says_how_long_training_ran_after_the_last_group(tmp_path):
    """Under sync the learner works only once the batch is in: `time/after_last_group` is the
    training time (the sim's 0.05 s per step), the rest of `time/step` is sampling."""
    latency = {"sim.train_step_s": 0.05, "sim.sample_request_s": 0.02, "advantages.filter_constant": "false"}
    summary = await run_sim(tmp_path, scheduler="sync", steps=3, set=latency)
    for row in summary.metrics:
        assert 0.05 <= row["time/after_last_group"] < 0.05 + 0.03, row
        assert row["time/step"] - row["time/after_last_group"] >= 0.02  # at least one sample request

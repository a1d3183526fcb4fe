"""Fault injection: runs under 10-30% failures finish with every group trained or counted."""

from __future__ import annotations

import asyncio

import pytest
from helpers import run_sim

pytestmark = pytest.mark.timeout(60)


def _accounted(summary, batch_size: int) -> None:
    rows = summary.metrics
    seen = sum(r["groups/trained"] + r["groups/filtered"] + r["groups/dropped"] for r in rows)
    assert seen == len(rows) * batch_size, "a group was neither trained nor counted as dropped"


def _no_tasks_left() -> None:
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not others, f"tasks left running after the run: {others}"


@pytest.mark.parametrize("fail_rate", [0.1, 0.2, 0.3])
@pytest.mark.parametrize("scheduler", ["sync", "async"])
async def test_env_failures_are_retried_within_budget(tmp_path, fail_rate, scheduler):
    budget = 3
    summary = await run_sim(
        tmp_path,
        env="faulty",
        scheduler=scheduler,
        steps=8,
        batch_size=8,
        group_size=4,
        set={"env_options.fail_rate": fail_rate, "retry.budget": budget, "retry.max_consecutive_dropped": 50},
    )
    _accounted(summary, 8)
    last = summary.metrics[-1]
    errors, dropped = last["rollout_errors/total"], sum(r["groups/dropped"] for r in summary.metrics)
    assert errors > 0, "no fault was injected"
    # each surviving group spent at most its budget; a dropped one at most budget + 1 failures
    assert errors <= (8 * 8 - dropped) * budget + dropped * (budget + 1)
    _no_tasks_left()


async def test_hanging_and_slow_envs_under_a_rollout_timeout(tmp_path):
    summary = await run_sim(
        tmp_path,
        env="faulty",
        scheduler="async",
        steps=5,
        batch_size=4,
        set={
            "env_options.hang_rate": 0.1,
            "env_options.slow_rate": 0.2,
            "retry.rollout_timeout_s": 0.2,
            "retry.budget": 4,
            "retry.max_consecutive_dropped": 50,
        },
    )
    _accounted(summary, 4)
    assert summary.metrics[-1].get("rollout_errors/TimeoutError", 0) > 0
    _no_tasks_left()


async def test_transient_sampler_faults_are_retried_by_the_sampler_and_spend_no_budget(tmp_path):
    summary = await run_sim(
        tmp_path,
        scheduler="stream",
        num_minibatches=2,
        steps=6,
        batch_size=4,
        set={"sim.sample_fail_rate": 0.2, "retry.budget": 0},
    )
    sampling = summary.backend.sampling
    assert sampling.injected["transient"] > 0
    _accounted(summary, 4)
    assert sum(r["groups/dropped"] for r in summary.metrics) == 0
    assert summary.metrics[-1]["rollout_errors/total"] == 0
    _no_tasks_left()


async def test_a_permanent_sampler_fault_stops_the_run_as_itself(tmp_path):
    """The backend's failure, not the env's: no retry budget pays for it (issue 22, item 8)."""
    with pytest.raises(RuntimeError, match="sampler crashed on this request") as raised:
        await run_sim(tmp_path, steps=6, batch_size=4, set={"sim.sample_fatal_rate": 0.1, "retry.budget": 4})
    assert "TooManyDroppedGroups" not in type(raised.value).__name__
    _no_tasks_left()


async def test_learner_submissions_refused_transiently_are_retried_once_each(tmp_path):
    summary = await run_sim(
        tmp_path,
        steps=6,
        set={"sim.train_fail_rate": 0.3, "advantages.filter_constant": "false"},
    )
    training = summary.backend.training
    assert training.refused > 0
    assert training.applied_steps == 6
    fbs = [s for s in training.timeline if s.op == "forward_backward"]
    assert len(fbs) == 6, "a refused submission was applied, or one was lost"

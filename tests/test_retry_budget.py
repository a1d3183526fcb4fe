"""The retry budget: fresh env per retry, shared budget, cancellation, dropped groups, timeouts."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import anyio
import pytest
from helpers import run_sim

from headrace import Env, EnvGroupBuilder, ProblemDataset, StepResult, StopCondition
from headrace.core.rollout import TooManyDroppedGroups
from headrace.run.metrics import NoUpdateApplied

pytestmark = pytest.mark.timeout(30)


@dataclass
class Journal:
    """What happened to the envs of a test, shared by the builders (tests run in one process)."""

    made: int = 0
    steps: int = 0
    cancelled: int = 0
    cleanups: int = 0
    env_ids: list[int] = field(default_factory=list)


class ScriptedEnv(Env):
    """Behaviour by (member, attempt): 'ok', 'raise', 'hang'."""

    def __init__(self, journal: Journal, behaviour: str):
        self.journal, self.behaviour = journal, behaviour

    async def initial_observation(self):
        return [5, 6, 7], StopCondition(4, (2,))

    async def step(self, action):
        self.journal.steps += 1
        self.journal.env_ids.append(id(self))
        if self.behaviour == "raise":
            raise RuntimeError("sandbox crashed")
        if self.behaviour == "hang":
            try:
                await anyio.sleep(3600)
            except BaseException:
                self.journal.cancelled += 1
                raise
        return StepResult(reward=float(len(action.tokens) % 2), done=True)


class ScriptedGroup(EnvGroupBuilder):
    def __init__(self, journal: Journal, script: dict[int, list[str]], size: int = 4):
        self.journal, self.script, self.size = journal, script, size
        self.calls = 0

    async def make_envs(self):
        attempt = self.calls
        self.calls += 1
        self.journal.made += 1
        return [
            ScriptedEnv(self.journal, self.script.get(i, ["ok"])[min(attempt, len(self.script.get(i, ["ok"])) - 1)])
            for i in range(self.size)
        ]

    async def cleanup(self):
        self.journal.cleanups += 1


def metrics_of(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def dataset_of(make_builder, batches: int = 3, per_batch: int = 2) -> ProblemDataset:
    return ProblemDataset(lambda rng: make_builder(), per_batch, batches, seed=0)


async def test_failed_member_is_retried_with_a_fresh_env(tmp_path):
    journal = Journal()
    data = dataset_of(lambda: ScriptedGroup(journal, {0: ["raise", "ok"]}), batches=2)
    summary = await run_sim(
        tmp_path, steps=2, dataset=data, set={"retry.budget": 1, "advantages.filter_constant": "false"}
    )
    assert sum(r["groups/dropped"] for r in summary.metrics) == 0
    assert journal.made == 4 * 2  # 4 groups: one make_envs each, plus one fresh set per retry
    assert len(set(journal.env_ids)) == journal.steps, "a retry reused an env"
    assert summary.metrics[-1]["rollout_errors/RuntimeError"] == 4
    assert journal.cleanups == 4


async def test_budget_is_shared_by_the_group_and_spending_it_drops_the_group(tmp_path):
    journal = Journal()
    # two members fail once each: a budget of 1 covers only one of them
    data = dataset_of(lambda: ScriptedGroup(journal, {0: ["raise", "ok"], 1: ["raise", "ok"]}), batches=2)
    with pytest.raises(NoUpdateApplied, match="4 groups were dropped"):  # every group: nothing trained
        await run_sim(tmp_path, steps=2, dataset=data, set={"retry.budget": 1, "retry.max_consecutive_dropped": 100})
    rows = metrics_of(tmp_path)
    assert sum(r["groups/dropped"] for r in rows) == 4
    assert rows[-1]["rollout_errors/groups_dropped"] >= 1
    assert all(r["groups/trained"] + r["groups/filtered"] == 0 for r in rows)
    assert journal.cleanups == 4


async def test_spent_budget_cancels_the_groups_pending_rollouts(tmp_path):
    journal = Journal()
    data = dataset_of(lambda: ScriptedGroup(journal, {0: ["raise"], 1: ["hang"], 2: ["hang"]}), batches=1, per_batch=1)
    with anyio.fail_after(10), pytest.raises(NoUpdateApplied):  # the hanging members must not hold the run
        await run_sim(tmp_path, steps=1, dataset=data, set={"retry.budget": 0})
    assert metrics_of(tmp_path)[0]["groups/dropped"] == 1
    assert journal.cancelled == 2
    assert journal.cleanups == 1


async def test_partial_groups_keep_the_survivors_when_configured(tmp_path):
    journal = Journal()
    data = dataset_of(lambda: ScriptedGroup(journal, {0: ["raise"]}), batches=1, per_batch=1)
    summary = await run_sim(
        tmp_path,
        steps=1,
        dataset=data,
        set={"retry.budget": 0, "retry.partial_groups": "true", "advantages.filter_constant": "false"},
    )
    assert summary.metrics[0]["groups/dropped"] == 0
    assert summary.metrics[0]["throughput/trajectories"] < 4


async def test_consecutive_dropped_groups_stop_the_run(tmp_path):
    journal = Journal()
    data = dataset_of(lambda: ScriptedGroup(journal, {i: ["raise"] for i in range(4)}), batches=10)
    with pytest.raises(TooManyDroppedGroups, match="in a row"):
        await run_sim(tmp_path, steps=10, dataset=data, set={"retry.budget": 2, "retry.max_consecutive_dropped": 3})


async def test_a_hanging_env_is_timed_out_and_retried(tmp_path):
    journal = Journal()
    data = dataset_of(lambda: ScriptedGroup(journal, {3: ["hang", "ok"]}), batches=1, per_batch=1)
    with anyio.fail_after(10):
        summary = await run_sim(
            tmp_path, steps=1, dataset=data, set={"retry.budget": 1, "retry.rollout_timeout_s": 0.2}
        )
    assert summary.metrics[0]["groups/dropped"] == 0
    assert summary.metrics[0]["rollout_errors/TimeoutError"] == 1
    assert journal.cancelled == 1


async def test_outside_cancellation_propagates_and_cleans_up(tmp_path):
    journal = Journal()
    data = dataset_of(lambda: ScriptedGroup(journal, {i: ["hang"] for i in range(4)}), batches=2)
    reached_after_run = False
    with anyio.move_on_after(0.5) as scope:
        await run_sim(tmp_path, steps=2, dataset=data, set={"retry.budget": 5})
        reached_after_run = True
    assert scope.cancelled_caught, "the run swallowed the cancellation"
    assert not reached_after_run
    assert journal.cancelled == 8 and journal.cleanups == 2


async def test_transient_sampler_errors_are_retried_with_backoff(tmp_path, monkeypatch):
    from headrace.backends import sim
    from headrace.core.retry import TransientBackendError

    real = sim.SimSampling.sample
    rng = random.Random(0)
    failures = []

    async def flaky(self, *args):
        if rng.random() < 0.3:
            failures.append(1)
            raise TransientBackendError("503 from the sampler")
        return await real(self, *args)

    monkeypatch.setattr(sim.SimSampling, "sample", flaky)
    summary = await run_sim(tmp_path, steps=3, env="guess_number")
    assert failures, "no fault was injected"
    assert sum(r["groups/dropped"] for r in summary.metrics) == 0
    assert summary.metrics[-1]["rollout_errors/total"] == 0

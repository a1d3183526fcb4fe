"""An env that raises ``CancelledError`` itself has failed: it is counted as that env's error and
retried. A real cancellation (shutdown, a timeout, a group that gave up) still passes through."""

from __future__ import annotations

import asyncio
import json

import anyio
import pytest
from helpers import run_sim

from headrace import Env, EnvGroupBuilder, ProblemDataset, StepResult, StopCondition
from headrace.run.metrics import NoUpdateApplied

pytestmark = pytest.mark.timeout(30)
TRAIN_ALL = {"advantages.filter_constant": "false", "retry.max_consecutive_dropped": 100}


class SelfCancelling(Env):
    """Raises ``CancelledError`` where ``where`` says, on the attempts ``calls`` marks."""

    def __init__(self, where: str, cancel: bool):
        self.where, self.cancel = where, cancel

    async def initial_observation(self):
        if self.cancel and self.where == "start":
            raise asyncio.CancelledError()
        return [5, 6, 7], StopCondition(4, (2,))

    async def step(self, action):
        if self.cancel and self.where == "step":
            # what a cancelled inner task looks like to the code awaiting it
            inner = asyncio.ensure_future(asyncio.sleep(3600))
            inner.cancel()
            await inner
        return StepResult(reward=float(len(action.tokens) % 2), done=True)


class Group(EnvGroupBuilder):
    def __init__(self, where: str, cancelling_calls: int):
        self.where, self.cancelling_calls, self.made = where, cancelling_calls, 0

    async def make_envs(self):
        self.made += 1
        if self.where == "make_envs" and self.made <= self.cancelling_calls:
            raise asyncio.CancelledError()
        # member 0 cancels itself on its first `cancelling_calls` attempts
        return [SelfCancelling(self.where, i == 0 and self.made <= self.cancelling_calls) for i in range(4)]


def data(where: str, cancelling_calls: int) -> ProblemDataset:
    return ProblemDataset(lambda rng: Group(where, cancelling_calls), 2, 2, seed=0)


@pytest.mark.parametrize("where", ["step", "start", "make_envs"])
async def test_an_env_cancelling_itself_is_counted_and_retried(tmp_path, where):
    # today: the member vanishes, uncounted, and its group trains on the other three
    summary = await run_sim(
        tmp_path, steps=2, batch_size=2, dataset=data(where, 1), set={"retry.budget": 2, **TRAIN_ALL}
    )
    assert sum(r["throughput/trajectories"] for r in summary.metrics) == 4 * 4
    assert sum(r["groups/trained"] for r in summary.metrics) == 4
    assert summary.metrics[-1]["rollout_errors/EnvCancelledError"] >= 4


async def test_envs_that_always_cancel_themselves_drop_their_groups_and_fail_the_run(tmp_path):
    # today: every group is filtered with 0 trajectories and 0 errors, and the run exits 0
    with pytest.raises(NoUpdateApplied, match="EnvCancelledError"):
        await run_sim(tmp_path, steps=2, batch_size=2, dataset=data("step", 99), set={"retry.budget": 1, **TRAIN_ALL})
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["groups/dropped"] for r in rows] == [2, 2]
    assert rows[-1]["rollout_errors/EnvCancelledError"] == 4 * 2  # per group: the first try and its one retry


class Hangs(Env):
    async def initial_observation(self):
        return [5, 6, 7], StopCondition(4, (2,))

    async def step(self, action):
        await anyio.sleep(3600)


class HangingGroup(EnvGroupBuilder):
    async def make_envs(self):
        return [Hangs() for _ in range(4)]


async def test_outside_cancellation_is_never_taken_for_an_env_error(tmp_path):
    data = ProblemDataset(lambda rng: HangingGroup(), 2, 2, seed=0)
    with anyio.move_on_after(0.5) as scope:
        await run_sim(tmp_path, steps=2, dataset=data, set={"retry.budget": 5})
    assert scope.cancelled_caught, "the run swallowed the cancellation"


async def test_timeouts_and_a_group_giving_up_are_not_counted_as_self_cancellation(tmp_path):
    data = ProblemDataset(lambda rng: HangingGroup(), 1, 1, seed=0)
    with pytest.raises(NoUpdateApplied):
        await run_sim(
            tmp_path, steps=1, dataset=data, set={"retry.budget": 1, "retry.rollout_timeout_s": 0.1, **TRAIN_ALL}
        )
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # members time out together: the budget pays for one timeout, the next drops the group and
    # cancels the members still running; none of that is an env cancelling itself
    assert row["rollout_errors/TimeoutError"] >= 2 and "rollout_errors/EnvCancelledError" not in row

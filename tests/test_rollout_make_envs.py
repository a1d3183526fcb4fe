"""``make_envs`` failing, hanging or returning too few envs, first or on a retry: each counts
against the group's retry budget like any env error, under ``retry.rollout_timeout_s``."""

from __future__ import annotations

import itertools

import anyio
import pytest
from helpers import run_sim

from headrace import Env, EnvGroupBuilder, ProblemDataset, StepResult, StopCondition

pytestmark = pytest.mark.timeout(30)
TRAIN_ALL = {"advantages.filter_constant": "false", "retry.max_consecutive_dropped": 100}


class Sandbox(Env):
    def __init__(self, crash: bool):
        self.crash = crash

    async def initial_observation(self):
        return [5, 6, 7], StopCondition(4, (2,))

    async def step(self, action):
        if self.crash:
            raise RuntimeError("sandbox crashed")
        return StepResult(reward=float(len(action.tokens) % 2), done=True)


class Pool(EnvGroupBuilder):
    """Call k of ``make_envs`` does ``calls[k]`` (the last one repeats): 'ok'; 'crash3', whose
    member 3 crashes so that it needs a retry; 'raise'; 'hang'; 'short' (one env for four)."""

    def __init__(self, calls: list[str]):
        self.calls, self.made = calls, 0

    async def make_envs(self):
        kind = self.calls[min(self.made, len(self.calls) - 1)]
        self.made += 1
        if kind == "raise":
            raise RuntimeError("sandbox pool exhausted")
        if kind == "hang":
            await anyio.sleep(3600)
        if kind == "short":
            return [Sandbox(False)]
        return [Sandbox(kind == "crash3" and i == 3) for i in range(4)]


def pools(calls: list[str]) -> ProblemDataset:
    return ProblemDataset(lambda rng: Pool(calls), 2, 2, seed=0)


@pytest.mark.parametrize(
    ("calls", "error"),
    [
        (["crash3", "raise", "ok"], "RuntimeError"),  # today: the run dies with the traceback
        (["crash3", "short", "ok"], "WrongEnvCount"),  # today: IndexError
        (["raise", "ok"], "RuntimeError"),  # the first call: retried too, no longer dropped at once
    ],
)
async def test_make_envs_failing_is_retried_within_the_budget(tmp_path, calls, error):
    summary = await run_sim(tmp_path, steps=2, batch_size=2, dataset=pools(calls), set={"retry.budget": 3, **TRAIN_ALL})
    last = summary.metrics[-1]
    assert sum(r["groups/trained"] for r in summary.metrics) == 4
    assert sum(r["throughput/trajectories"] for r in summary.metrics) == 16
    assert last[f"rollout_errors/{error}"] >= 4  # once per group at least


async def test_make_envs_failing_on_every_retry_drops_the_group_not_the_run(tmp_path):
    groups = itertools.count()  # every other group's pool is broken for good
    data = ProblemDataset(lambda rng: Pool(["crash3", "raise"] if next(groups) % 2 else ["ok"]), 2, 2, seed=0)
    summary = await run_sim(tmp_path, steps=2, batch_size=2, dataset=data, set={"retry.budget": 2, **TRAIN_ALL})
    assert [(r["groups/trained"], r["groups/dropped"]) for r in summary.metrics] == [(1, 1), (1, 1)]
    # budget 2 pays for the crash and one failed make_envs; the second failed make_envs drops the group
    assert summary.metrics[-1]["rollout_errors/RuntimeError"] == 2 * 3


@pytest.mark.parametrize("calls", [["crash3", "hang", "ok"], ["hang", "ok"]], ids=["on_a_retry", "first"])
async def test_a_hanging_make_envs_is_timed_out_and_counted(tmp_path, calls):
    with anyio.fail_after(15):  # today: the run hangs for good
        summary = await run_sim(
            tmp_path,
            steps=2,
            batch_size=2,
            dataset=pools(calls),
            set={"retry.budget": 3, "retry.rollout_timeout_s": 0.3, **TRAIN_ALL},
        )
    assert sum(r["groups/trained"] for r in summary.metrics) == 4
    assert summary.metrics[-1]["rollout_errors/TimeoutError"] == 4

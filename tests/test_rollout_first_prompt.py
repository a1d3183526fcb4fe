"""Each env is asked for its first prompt once, whether the group shares it or not."""

from __future__ import annotations

import pytest
from helpers import run_sim

from headrace import Env, EnvGroupBuilder, ProblemDataset, StepResult, StopCondition

pytestmark = pytest.mark.timeout(30)


class Counted(Env):
    def __init__(self, prompt: list[int], asked: list[int]):
        self.prompt, self.asked = prompt, asked

    async def initial_observation(self):
        self.asked.append(1)
        return list(self.prompt), StopCondition(4, (2,))

    async def step(self, action):
        return StepResult(reward=float(len(action.tokens) % 2), done=True)


class Group(EnvGroupBuilder):
    def __init__(self, shared: bool, asked: list[int]):
        self.shared, self.asked = shared, asked

    async def make_envs(self):
        return [Counted([5, 6] if self.shared else [5, 6, 7 + i], self.asked) for i in range(4)]


@pytest.mark.parametrize("shared", [True, False])
async def test_each_env_is_asked_for_its_first_prompt_once(tmp_path, shared):
    asked: list[int] = []
    dataset = ProblemDataset(lambda rng: Group(shared, asked), batch_size=2, num_batches=3, seed=0)
    summary = await run_sim(
        tmp_path, dataset=dataset, steps=3, batch_size=2, set={"advantages.filter_constant": "false"}
    )
    trajectories = sum(row["throughput/trajectories"] for row in summary.metrics)
    assert trajectories == 3 * 2 * 4
    assert len(asked) == trajectories  # before: 2x when the group's prompts differed

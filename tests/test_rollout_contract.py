"""The env contract: token ids the model can read, ``max_tokens >= 1``, number rewards and
metrics. A broken one fails the run at once (never retried), naming the env and the value; the
metrics of ``StepResult`` reach ``metrics.jsonl``."""

from __future__ import annotations

import json
import re

import pytest
from helpers import run_argv, run_sim

from headrace import Env, EnvContext, EnvGroupBuilder, GroupOf, ProblemDataset, StepResult, StopCondition
from headrace.app.cli import main
from headrace.core.episode import EnvContractError
from headrace.plugins import registry

pytestmark = pytest.mark.timeout(30)
VOCAB = 56  # the sim's character tokenizer


class Broken(Env):
    """Breaks the contract one way, on its second turn where that is a multi-turn matter."""

    made = 0

    def __init__(self, mode: str):
        self.mode = mode
        Broken.made += 1

    async def initial_observation(self):
        prompt = {"oov_prompt": [5, VOCAB + 7], "negative_id": [5, -1], "float_id": [5, 6.0]}.get(self.mode, [5, 6])
        return prompt, StopCondition(0 if self.mode == "zero_max_tokens" else 4, (2,))

    async def step(self, action):
        observation = [5, 6, *action.tokens]  # extends the last observation + action: sampled ids pass
        match self.mode:
            case "str_next_observation":
                return StepResult(0.0, done=False, next_observation="guess again:")
            case "oov_next_observation":
                return StepResult(0.0, done=False, next_observation=[*observation, 500])
            case "negative_next_max_tokens":
                return StepResult(0.0, done=False, next_observation=observation, next_stop=StopCondition(-1))
            case "str_reward":
                return StepResult("1.0", done=True)
            case "none_reward":
                return StepResult(None, done=True)
            case "str_metric":
                return StepResult(1.0, done=True, metrics={"solved": "yes"})
        return StepResult(1.0, done=True)


@pytest.mark.parametrize(
    ("mode", "fragment"),
    [
        ("str_next_observation", "Broken.step() (next_observation) gave the str 'guess again:' as token ids"),
        (
            "oov_next_observation",
            "Broken.step() (next_observation) gave the token id 500, outside the tokenizer's vocabulary (ids 0..55)",
        ),
        ("oov_prompt", "Broken.initial_observation() gave the token id 63, outside the tokenizer's vocabulary"),
        ("negative_id", "gave the token id -1, outside"),
        ("float_id", "Broken.initial_observation() gave a list holding 6.0 as token ids"),
        (
            "zero_max_tokens",
            "Broken.initial_observation() gave StopCondition(max_tokens=0); max_tokens must be an int >= 1",
        ),
        ("negative_next_max_tokens", "Broken.step() (next_stop) gave StopCondition(max_tokens=-1)"),
        ("str_reward", "Broken.step() gave the reward '1.0' (str); a reward must be a number"),
        ("none_reward", "Broken.step() gave the reward None (NoneType)"),
        ("str_metric", "Broken.step() gave metrics {'solved': 'yes'}; metrics must be a dict of name -> number"),
    ],
)
async def test_a_broken_contract_fails_fast_naming_the_env_and_the_value(tmp_path, mode, fragment):
    # today: the first five are retried as transient errors until the groups are dropped (or
    # they train on garbage), the max_tokens ones reach the sampler, the rest crash deep inside
    Broken.made = 0
    data = ProblemDataset(lambda rng: GroupOf(Broken, {"mode": mode}, 2), 1, 4, 0)
    with pytest.raises(EnvContractError, match=re.escape(fragment)):
        await run_sim(tmp_path, steps=4, batch_size=1, dataset=data, set={"retry.budget": 3, "max_turns": 3})
    assert Broken.made == 2, "a contract error was retried"


class JudgedGroup(EnvGroupBuilder):
    async def make_envs(self):
        return [Broken("ok"), Broken("ok")]

    async def compute_group_rewards(self, trajectories_G):
        return [("high", {}) for _ in trajectories_G]


async def test_a_group_reward_of_the_wrong_type_is_a_contract_error(tmp_path):
    data = ProblemDataset(lambda rng: JudgedGroup(), 1, 2, 0)
    with pytest.raises(
        EnvContractError, match=re.escape("JudgedGroup.compute_group_rewards() gave the reward 'high' (str)")
    ):
        await run_sim(tmp_path, steps=2, batch_size=1, dataset=data)


@pytest.mark.parametrize("env", ["arithmetic", "guess_number"])
async def test_step_metrics_reach_metrics_jsonl_per_env_tag(tmp_path, env):
    await run_sim(tmp_path, env=env, steps=3, set={"advantages.filter_constant": "false"})
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    name = {"arithmetic": "correct", "guess_number": "solved"}[env]
    for row in rows:
        assert row[f"env/all/{name}"] == row[f"env/{env}/{name}"]
        if env == "arithmetic":  # one step, reward = correct, equal groups: the same mean
            assert row["env/all/correct"] == pytest.approx(row["reward/mean"])
            assert 0.0 <= row["env/arithmetic/exact"] <= 1.0
        else:
            assert 1.0 <= row["env/guess_number/guesses"] <= 4.0


def make_str_reward_dataset(ctx: EnvContext) -> ProblemDataset:
    return ProblemDataset(
        lambda rng: GroupOf(Broken, {"mode": "str_reward"}, ctx.group_size), ctx.batch_size, ctx.steps, ctx.seed
    )


@pytest.fixture
def str_reward_env():
    with registry.envs.temporarily("test_contract_str_reward", make_str_reward_dataset):
        yield "test_contract_str_reward"


def test_cli_a_contract_error_exits_1_with_one_paragraph(tmp_path, capsys, str_reward_env):
    argv = run_argv(env=str_reward_env, steps=2, group_size=2, run_dir=tmp_path / "r")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Broken.step() gave the reward '1.0' (str)" in err and "Traceback" not in err

"""Non-finite numbers never reach the weights: a NaN, infinite or float32-overflowing reward is an
env contract error; advantages and logprobs are checked before any backend sees them; is_constant
does not depend on where a NaN sits (issue 10, item 2; the torch learner's guard is in
test_nonfinite_torch.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from helpers import run_argv, run_sim

from headrace import Env, ProblemDataset, StepResult, StopCondition
from headrace.app.cli import main
from headrace.core.advantages import NonFiniteError, group_advantages, is_constant
from headrace.core.datums import trajectory_to_datums
from headrace.core.episode import EnvContractError
from headrace.core.types import EnvGroupBuilder, SampledTokens, StopReason, Trajectory, Transition
from headrace.plugins import registry

pytestmark = pytest.mark.timeout(60)
NAN, INF = float("nan"), float("inf")


class BadReward(Env):
    """Member 1 of each group gets ``value`` as its step reward; the others 0 or 1."""

    def __init__(self, value: float, member: int):
        self.value, self.member = value, member

    async def initial_observation(self):
        return [5, 6], StopCondition(4)

    async def step(self, action):
        return StepResult(reward=self.value if self.member == 1 else float(self.member % 2), done=True)


class BadGroup(EnvGroupBuilder):
    """``where`` = "step": member 1's step reward is ``value``; "group": its group reward is."""

    def __init__(self, value: float, where: str, size: int = 4):
        self.value, self.where, self.size = value, where, size

    async def make_envs(self):
        value = self.value if self.where == "step" else 0.0
        return [BadReward(value if i == 1 else 0.0, i) for i in range(self.size)]

    async def compute_group_rewards(self, trajectories_G):
        return [((self.value if i == 1 and self.where == "group" else 0.0), {}) for i in range(len(trajectories_G))]


def bad_data(value: float, where: str) -> ProblemDataset:
    return ProblemDataset(lambda rng: BadGroup(value, where), 2, 3, 0)


@pytest.mark.parametrize("value", [NAN, INF, -INF, 1e308, -1e308])
@pytest.mark.parametrize(
    ("where", "source"), [("step", "BadReward.step()"), ("group", "BadGroup.compute_group_rewards()")]
)
async def test_a_non_finite_reward_is_an_env_contract_error_naming_the_env_and_the_value(
    tmp_path, value, where, source
):
    problem = "is NaN" if math.isnan(value) else "is infinite" if math.isinf(value) else "beyond float32's range"
    with pytest.raises(EnvContractError) as raised:
        await run_sim(tmp_path, steps=3, dataset=bad_data(value, where), set={"advantages.filter_constant": "false"})
    message = str(raised.value)
    assert source in message and repr(value) in message and problem in message
    # raised before anything was applied: no step was trained or reported
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""


def test_cli_exits_1_with_one_paragraph_on_a_nan_reward(tmp_path, capsys):
    with registry.envs.temporarily("test_nan_reward", lambda ctx: bad_data(NAN, "step")):
        code = main(run_argv(env="test_nan_reward", run_dir=tmp_path / "r"))
    err = capsys.readouterr().err
    assert code == 1
    assert "BadReward.step() returned the reward nan" in err and "Traceback" not in err


@pytest.mark.parametrize("rewards", [[1.0, NAN, 1.0], [NAN, 1.0, 1.0], [1.0, 1.0, NAN], [INF, INF], [1.0, -INF]])
def test_a_group_holding_a_nan_or_an_infinity_is_never_constant(rewards):
    # it must reach group_advantages, which refuses it, instead of being silently filtered
    assert not is_constant(rewards)
    with pytest.raises(NonFiniteError):
        group_advantages(rewards, normalize_std=True)


def test_constant_groups_are_still_constant():
    assert is_constant([1.0, 1.0, 1.0]) and is_constant([]) and not is_constant([1.0, 0.0])


@pytest.mark.parametrize("normalize_std", [True, False])
def test_rewards_beyond_float32_are_refused_by_group_advantages(normalize_std):
    with pytest.raises(NonFiniteError, match="float32"):
        group_advantages([1e308, -1e308, 1e308, -1e308], normalize_std)


def test_rewards_at_float32s_edge_give_finite_advantages_or_a_clear_error():
    big = 3.4e38
    normalised = group_advantages([big, -big, big, -big], normalize_std=True)
    assert normalised == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
    assert group_advantages([big, -big], normalize_std=False) == [big, -big]
    # centred, these would overflow float32 (−4.5e38): refused, with the way out
    with pytest.raises(NonFiniteError, match="normalize_std"):
        group_advantages([big, -big, big], normalize_std=False)


def test_ordinary_advantages_are_unchanged():
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([1.0, 0.0], normalize_std=True) == pytest.approx([1.0, -1.0], abs=1e-5)


def _trajectory(logprobs: list[float]) -> Trajectory:
    action = SampledTokens([7] * len(logprobs), logprobs, StopReason.LENGTH, 0)
    return Trajectory([Transition([5, 6], action, 1.0, True, {})], StopReason.DONE)


@pytest.mark.parametrize("advantage", [NAN, INF, -INF, 1e39])
def test_a_datum_with_a_non_finite_advantage_is_never_built(advantage):
    with pytest.raises(NonFiniteError, match="advantage"):
        trajectory_to_datums(_trajectory([-1.0, -2.0]), advantage)


@pytest.mark.parametrize("bad", [NAN, -INF, INF, -1e39])
def test_a_datum_with_a_non_finite_sampler_logprob_is_never_built(bad):
    with pytest.raises(NonFiniteError, match="logprob"):
        trajectory_to_datums(_trajectory([-1.0, bad, -0.5]), 1.0)
    assert trajectory_to_datums(_trajectory([-1.0, -0.5]), 1.0)[0].logprobs[-2:] == [-1.0, -0.5]


async def test_a_nan_sampler_logprob_stops_a_sim_run_before_any_forward_backward(tmp_path, monkeypatch):
    from headrace.backends import sim
    from headrace.core import sampler as sampler_module

    real_sample = sampler_module.SamplerActor.sample
    calls: list[int] = []

    async def corrupt(self, prompt, n, params):
        return [
            dataclasses.replace(s, logprobs=[NAN, *s.logprobs[1:]]) for s in await real_sample(self, prompt, n, params)
        ]

    real_forward_backward = sim.SimTraining.forward_backward

    def counted(self, *args):
        calls.append(1)
        return real_forward_backward(self, *args)

    monkeypatch.setattr(sampler_module.SamplerActor, "sample", corrupt)
    monkeypatch.setattr(sim.SimTraining, "forward_backward", counted)
    with pytest.raises(NonFiniteError, match="the sampler returned the logprob nan"):
        await run_sim(tmp_path, steps=2, set={"advantages.filter_constant": "false"})
    assert calls == []

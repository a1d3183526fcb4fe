"""Held-out evaluation during training (eval.every): its rows, its isolation from training, its
failures, and what it costs the learner."""

from __future__ import annotations

import json
import math

import pytest
from helpers import run_sim

from headrace import EnvContext, GroupOf, ProblemDataset
from headrace.core.episode import EnvContractError
from headrace.core.errors import ConfigError
from headrace.core.evaluate import pass_at_k
from headrace.core.types import Env, SampledTokens, StepResult, StopCondition, Tokens
from headrace.plugins import registry

pytestmark = pytest.mark.timeout(120)

COUNTS = ("groups/trained", "groups/filtered", "groups/dropped", "throughput/trajectories")
LATENCY = {"sim.sample_token_s": 0.001, "sim.train_step_s": 0.02, "sim.optim_step_s": 0.01}


def rows(summary) -> list[dict]:
    return [json.loads(line) for line in open(f"{summary.run_dir}/metrics.jsonl")]


def eval_versions(rs: list[dict], env: str = "arithmetic") -> list[int]:
    return [int(r[f"eval/{env}/version"]) for r in rs if f"eval/{env}/version" in r]


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0  # n == k: any correct
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))


async def test_sim_eval_rows_have_the_right_versions_and_leave_training_alone(tmp_path):
    flags = dict(steps=6, set=LATENCY)
    off = rows(await run_sim(tmp_path / "off", **flags))
    on_summary = await run_sim(
        tmp_path / "on", **(flags | {"set": LATENCY | {"eval.every": 2, "eval.problems": 8, "eval.samples": 4}})
    )
    on = rows(on_summary)
    assert [r["step"] for r in on] == list(range(6))  # still one row per step
    versions = eval_versions(on)
    # due at the start (0), after steps 1 and 3, and at the end (6); one due while another runs is
    # skipped, and one finished but not yet reported when the last one finishes is superseded
    assert versions == sorted(versions) and set(versions) <= {0, 2, 4, 6}
    assert versions[0] == 0 and versions[-1] == 6 and "eval/arithmetic/version" in on[-1]
    last = on[-1]
    assert len(versions) + last["eval/arithmetic/skipped"] + last["eval/arithmetic/superseded"] == 4
    for r in on:
        if "eval/arithmetic/version" in r:
            assert 0 <= r["eval/arithmetic/accuracy"] <= r["eval/arithmetic/pass@4"] <= 1
            assert r["eval/arithmetic/problems"] == 8 and r["eval/arithmetic/errors"] == 0
    # eval rollouts are never trained: the training rows see the same groups and trajectories
    assert [[r[k] for k in COUNTS] for r in on] == [[r[k] for k in COUNTS] for r in off]
    assert [r["reward/mean"] for r in on] == [r["reward/mean"] for r in off]


class _Broken(Env):
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def initial_observation(self) -> tuple[Tokens, StopCondition]:
        return self.tokenizer.encode("1+1="), StopCondition(4, (self.tokenizer.eos_token_id,))

    async def step(self, action: SampledTokens) -> StepResult:
        raise RuntimeError("grader crashed")


def _broken_dataset(ctx: EnvContext) -> ProblemDataset:
    return ProblemDataset(
        lambda rng: GroupOf(_Broken, {"tokenizer": ctx.tokenizer}, ctx.group_size), ctx.batch_size, 1, 0
    )


async def test_an_eval_env_that_raises_is_counted_and_the_run_goes_on(tmp_path):
    with registry.envs.temporarily("test_eval_broken", _broken_dataset):
        summary = await run_sim(
            tmp_path, steps=4, set={"eval.every": 2, "eval.env": "test_eval_broken", "eval.problems": 3}
        )
    assert summary.steps == 4
    evals = [r for r in rows(summary) if "eval/test_eval_broken/version" in r]
    assert evals and all(r["eval/test_eval_broken/errors"] == 3 for r in evals)
    assert all(r["eval/test_eval_broken/accuracy"] is None for r in evals)  # NaN: nothing was graded


class _WrongStep(_Broken):
    async def step(self, action: SampledTokens) -> StepResult:
        return "done"  # type: ignore[return-value] - the contract broken on purpose


def _wrong_step_dataset(ctx: EnvContext) -> ProblemDataset:
    return ProblemDataset(
        lambda rng: GroupOf(_WrongStep, {"tokenizer": ctx.tokenizer}, ctx.group_size), ctx.batch_size, 1, 0
    )


async def test_an_eval_env_that_breaks_its_contract_stops_the_run_as_a_rollout_would(tmp_path):
    """Eval runs its groups through the rollouts' lifecycle, contract checks included: a broken
    eval env is the same EnvContractError as the same env in training, not an eval/errors count."""
    with registry.envs.temporarily("test_eval_contract", _wrong_step_dataset):
        with pytest.raises(EnvContractError) as in_eval:
            await run_sim(tmp_path / "eval", steps=4, set={"eval.every": 2, "eval.env": "test_eval_contract"})
        with pytest.raises(EnvContractError) as in_training:
            await run_sim(tmp_path / "train", steps=4, env="test_eval_contract")
    assert str(in_eval.value) == str(in_training.value)
    assert "_WrongStep.step() returned" in str(in_eval.value)


async def test_eval_does_not_block_the_learner(tmp_path):
    """With the sim's latency model, an eval after every step costs the learner little: its step
    times (the last one, which waits for the final eval, aside) stay within a small factor of eval
    off. A loose bound: the point is that the learner never waits for an eval."""
    latency = LATENCY | {"advantages.filter_constant": "false"}  # every step trains
    off = rows(await run_sim(tmp_path / "off", steps=10, set=latency))
    on = rows(
        await run_sim(
            tmp_path / "on", steps=10, set=latency | {"eval.every": 1, "eval.problems": 32, "eval.samples": 4}
        )
    )
    assert len(eval_versions(on)) >= 2  # it evaluated, more than the final version

    def step_time(rs: list[dict]) -> float:
        return sum(r["time/step"] for r in rs[:-1]) / (len(rs) - 1)

    ratio = step_time(on) / step_time(off)
    skipped = on[-1]["eval/arithmetic/skipped"]
    print(f"eval on/off mean step time ratio: {ratio:.2f}; evals {eval_versions(on)}, skipped {skipped}")
    assert ratio < 2.0


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_torch_tiny_eval_accuracy_on_arithmetic(tmp_path):
    summary = await run_sim(
        tmp_path,
        backend="torch",
        steps=3,
        batch_size=4,
        group_size=4,
        set={
            "eval.every": 2,
            "eval.problems": 8,
            "eval.samples": 2,
            "torch.device": "cpu",
            "advantages.filter_constant": False,
        },
    )
    evals = [r for r in rows(summary) if "eval/arithmetic/version" in r]
    assert eval_versions(evals)[0] == 0 and evals[-1]["eval/arithmetic/version"] == 3
    for r in evals:
        assert 0.0 <= r["eval/arithmetic/accuracy"] <= 1.0
        assert 0.0 <= r["eval/arithmetic/pass@2"] <= 1.0


async def test_an_eval_env_that_cannot_be_built_is_a_config_error_naming_eval(tmp_path):
    with pytest.raises(ConfigError, match=r"^eval: .*unknown env 'nope'.*eval\.env"):
        await run_sim(tmp_path, steps=2, set={"eval.every": 1, "eval.env": "nope"})

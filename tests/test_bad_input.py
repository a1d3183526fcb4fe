"""Bad input: each answered by one clear paragraph, never a traceback from deep inside."""

from __future__ import annotations

import json
import re

import anyio
import pytest
from helpers import run_argv, run_sim

from headrace import Env, GroupOf, ProblemDataset, StepResult, StopCondition
from headrace.app.cli import main
from headrace.core import group
from headrace.core.episode import EnvContractError, PromptTooLongError
from headrace.core.errors import ConfigError
from headrace.plugins import registry
from headrace.run.config import build_config

pytestmark = pytest.mark.timeout(60)


def test_unknown_loss_names_the_closest():
    with pytest.raises(ConfigError, match="did you mean 'ppo'"):
        build_config(overrides=["loss.name=ppoo"])


class WrongStep(Env):
    def __init__(self, mode):
        self.mode = mode

    async def initial_observation(self):
        if self.mode == "empty_prompt":
            return [], StopCondition(4)
        if self.mode == "bad_observation":
            return "1+1=", StopCondition(4)
        return [5, 6], StopCondition(4)

    async def step(self, action):
        if self.mode == "bad_step":
            return 1.0
        return StepResult(reward=1.0, done=False)  # "not done" with no next observation


@pytest.mark.parametrize(
    ("mode", "fragment"),
    [
        ("empty_prompt", "empty prompt"),
        ("bad_observation", "must return (prompt_tokens: list[int], StopCondition)"),
        ("bad_step", "must return a headrace.StepResult"),
        ("no_next_observation", "done=False with no next_observation"),
    ],
)
async def test_env_breaking_its_contract_fails_the_run_clearly(tmp_path, mode, fragment):
    data = ProblemDataset(lambda rng: GroupOf(WrongStep, {"mode": mode}, 2), 2, 2, 0)
    with pytest.raises(EnvContractError, match=re.escape(fragment)):
        await run_sim(tmp_path, steps=2, dataset=data)


async def test_prompt_longer_than_the_context(tmp_path):
    with pytest.raises(PromptTooLongError, match="does not fit the model's context of 4 tokens"):
        await run_sim(tmp_path, steps=2, set={"sim.max_context": 4})


def _run(tmp_path, *extra):
    # without the constant-group filter, so a run this short trains something
    return run_argv(*extra, run_dir=tmp_path / "r", group_size=2, set={"advantages.filter_constant": "false"})


def test_cli_prompt_too_long_exits_1_with_the_reason(tmp_path, capsys):
    assert main(_run(tmp_path, "--set", "sim.max_context=3")) == 1
    err = capsys.readouterr().err
    assert "does not fit the model's context" in err and "Traceback" not in err


def test_resume_with_different_options_is_refused(tmp_path, capsys):
    assert main(_run(tmp_path)) == 0
    assert main(_run(tmp_path, "--resume", "--group-size", "4")) == 2
    assert "options differ: group_size" in capsys.readouterr().err


def test_overwrite_replaces_the_run(tmp_path):
    assert main(_run(tmp_path)) == 0
    assert main(_run(tmp_path, "--overwrite", "--steps", "2")) == 0
    rows = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2


def test_corrupt_checkpoint_pointer(tmp_path, capsys):
    assert main(_run(tmp_path)) == 0
    (tmp_path / "r" / "checkpoints" / "latest").write_text("{not json")
    assert main(_run(tmp_path, "--resume", "--steps", "5")) == 2
    assert "is corrupt" in capsys.readouterr().err


def test_missing_checkpoint(tmp_path, capsys):
    assert main(_run(tmp_path)) == 0
    latest = tmp_path / "r" / "checkpoints" / "latest"
    latest.write_text(json.dumps({"step": 3, "path": "not-a-checkpoint"}))
    assert main(_run(tmp_path, "--resume", "--steps", "5")) == 2
    err = capsys.readouterr().err
    assert "cannot resume from checkpoint 'not-a-checkpoint'" in err and "Traceback" not in err


def test_bad_env_options(tmp_path, capsys):
    assert main(_run(tmp_path, "--set", "env_options.max_operand=0")) == 2
    assert "env 'arithmetic' rejected its options" in capsys.readouterr().err


def make_crashing_factory(ctx):
    raise RuntimeError("the problem bank is unreachable")


def make_none(ctx):
    return None


def make_empty(ctx):
    return ProblemDataset(lambda rng: GroupOf(WrongStep, {"mode": "ok"}, 2), ctx.batch_size, 0, ctx.seed)


@pytest.fixture(autouse=True)
def broken_factories():
    """Registered for this file's tests only."""
    envs = registry.envs
    with (
        envs.temporarily("test_factory_crashes", make_crashing_factory),
        envs.temporarily("test_factory_gives_none", make_none),
        envs.temporarily("test_factory_gives_no_batches", make_empty),
    ):
        yield


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        # today: a RuntimeError traceback, an AttributeError and a ZeroDivisionError from deep inside
        (
            "test_factory_crashes",
            "env 'test_factory_crashes' failed to build its dataset (RuntimeError: the problem bank is unreachable)",
        ),
        (
            "test_factory_gives_none",
            "env 'test_factory_gives_none' gave NoneType as its dataset; an env factory must return a headrace.RLDataset",
        ),
        (
            "test_factory_gives_no_batches",
            "env 'test_factory_gives_no_batches' gave an empty dataset (ProblemDataset has no batches)",
        ),
    ],
)
def test_a_bad_env_factory_exits_2_with_one_paragraph(tmp_path, capsys, env, fragment):
    assert main(_run(tmp_path, "--env", env)) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


class FailingCleanup(GroupOf):
    async def cleanup(self):
        if self.kwargs["mode"] == "hang":
            await anyio.sleep(3600)
        raise RuntimeError("sandbox teardown failed")


@pytest.mark.parametrize("mode", ["raise", "hang"])
async def test_cleanup_that_fails_is_counted_and_logged_not_fatal(tmp_path, monkeypatch, mode):
    # today: the first failing cleanup ends the run with its traceback; a hanging one holds the
    # worker 30 s, uncounted
    monkeypatch.setattr(group, "CLEANUP_TIMEOUT_S", 0.05)

    class Quiet(WrongStep):
        async def step(self, action):
            return StepResult(reward=float(len(action.tokens) % 2), done=True)

    data = ProblemDataset(lambda rng: FailingCleanup(Quiet, {"mode": mode}, 4), 2, 3, 0)
    summary = await run_sim(tmp_path, steps=3, batch_size=2, dataset=data, set={"advantages.filter_constant": "false"})
    name = "RuntimeError" if mode == "raise" else "TimeoutError"
    assert summary.steps == 3
    assert summary.metrics[-1][f"rollout_errors/cleanup/{name}"] == 6
    logged = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert sum(e.get("event") == "cleanup_failed" for e in logged) == 6


class NoGroups(ProblemDataset):
    def get_batch(self, index):
        return [] if index == 0 else super().get_batch(index)


async def test_datasets_without_batches_or_groups_are_refused(tmp_path):
    empty = ProblemDataset(lambda rng: GroupOf(WrongStep, {"mode": "ok"}, 2), 2, 0, 0)
    with pytest.raises(ConfigError, match=re.escape("train(dataset=...) gave an empty dataset")):
        await run_sim(tmp_path, steps=2, dataset=empty)  # today: ZeroDivisionError
    no_groups = NoGroups(lambda rng: GroupOf(WrongStep, {"mode": "ok"}, 2), 2, 3, 0)
    with pytest.raises(EnvContractError, match=re.escape("NoGroups.get_batch(0) returned []; every batch needs")):
        await run_sim(tmp_path, steps=3, dataset=no_groups, overwrite=True)  # today: a bare ValueError

"""A run in which every group of every step was dropped or filtered trained nothing: it fails
(exit 1) with a summary that says so and names the top error causes."""

from __future__ import annotations

import json

import pytest
from helpers import run_argv, run_sim

from headrace import EnvContext, GroupOf, ProblemDataset
from headrace.app.cli import main
from headrace.envs.arithmetic import ArithmeticEnv
from headrace.plugins import registry
from headrace.run.metrics import NoUpdateApplied

pytestmark = pytest.mark.timeout(30)


def make_unanswerable(ctx: EnvContext) -> ProblemDataset:
    """The sim answers in digits: every member of every group scores 0, every group is filtered."""
    kwargs = dict(question="1+1=", answer="two", renderer=ctx.renderer, max_tokens=ctx.max_tokens)
    return ProblemDataset(
        lambda rng: GroupOf(ArithmeticEnv, kwargs, ctx.group_size), ctx.batch_size, ctx.steps, ctx.seed
    )


@pytest.fixture(autouse=True)
def unanswerable():
    with registry.envs.temporarily("test_unanswerable", make_unanswerable):
        yield


def _run(tmp_path, *extra: str) -> list[str]:
    return run_argv(*extra, run_dir=tmp_path / "r")


def test_every_group_dropped_exits_1_naming_the_top_errors(tmp_path, capsys):
    # today: exit 0 after 3 steps that trained nothing (the Tinker service rejecting every sample)
    args = _run(
        tmp_path, "--env", "faulty", "--set", "env_options.fail_rate=1.0", "--set", "retry.max_consecutive_dropped=100"
    )
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "no update was applied: in 3 steps, 6 groups were dropped" in err
    assert "Top errors: InjectedFault x" in err and "(injected failure in step)" in err and "Traceback" not in err
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # every step is still recorded


def test_every_group_filtered_exits_1_and_says_why(tmp_path, capsys):
    assert main(_run(tmp_path, "--env", "test_unanswerable")) == 1
    err = capsys.readouterr().err
    assert "no update was applied" in err and "6 were filtered (every member got the same reward)" in err
    assert "advantages.filter_constant=false" in err


async def test_train_raises_no_update_applied_but_one_update_is_enough(tmp_path):
    with pytest.raises(NoUpdateApplied, match="Top errors: none"):
        await run_sim(tmp_path, env="test_unanswerable", steps=2)
    # the same filtered groups, trained (zero advantages) once the filter is off: a normal run
    summary = await run_sim(
        tmp_path, env="test_unanswerable", steps=2, overwrite=True, set={"advantages.filter_constant": "false"}
    )
    assert summary.steps == 2
